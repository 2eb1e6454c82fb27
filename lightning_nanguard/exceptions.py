"""Errors raised by lightning_nanguard.

The hierarchy, so that a caller can catch as broadly or narrowly as it needs::

    NanGuardError (RuntimeError)            anything nanguard raises on purpose at run time
    ├── NonFiniteTrainingError              training went non-finite and the configured budget ran out
    │   └── RecoveryBudgetExhausted         a recovery (rollback, backoff) budget ran out
    ├── CheckpointVerificationError         a checkpoint failed its checksum / readability / finiteness check
    ├── UnsupportedSetupError               a strategy or optimizer setup nanguard refuses rather than mishandle
    └── BundleError                         an incident bundle that cannot be read or replayed (what to do is said)
    NanGuardConfigError (ValueError)        a constructor argument broke its rule (raised at construction)
    NanGuardWarning (UserWarning)           the category of every warning nanguard gives (filter it by category)

``brief(value)`` is how a message shows a value it did not choose (an argument, a file's contents): its ``repr``,
shortened, so that a 7 kB ``hparams`` or a deeply nested list is one readable line, never the whole of it.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "BundleError",
    "CheckpointVerificationError",
    "NanGuardConfigError",
    "NanGuardError",
    "NanGuardWarning",
    "NonFiniteTrainingError",
    "RankDivergenceError",
    "RecoveryBudgetExhausted",
    "UnsupportedSetupError",
    "brief",
]

BRIEF_CHARS = 160  # the most characters of a value an error message shows

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 6


def brief(value: object, limit: int = BRIEF_CHARS) -> str:
    """``repr(value)`` shortened for a message: nested containers cut at 3 levels and 6 items, strings at 60
    characters, the whole at ``limit`` characters (saying how long it was). Never raises."""
    try:
        text = _REPR.repr(value)
    except Exception:  # a value whose repr fails is still named
        text = f"<{type(value).__qualname__}>"
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text)} characters)"


class NanGuardError(RuntimeError):
    """Base class of the run-time errors nanguard raises on purpose."""


class NonFiniteTrainingError(NanGuardError):
    """Training produced non-finite values more often than the configured budget allows."""


class RecoveryBudgetExhausted(NonFiniteTrainingError):
    """A recovery budget (rollbacks, backoffs, loss-scale collapses) ran out."""


class RankDivergenceError(NanGuardError):
    """Under DDP the ranks' parameters differ (DDP never re-broadcasts them) and nothing verified could restore an
    agreed state."""


class CheckpointVerificationError(NanGuardError):
    """A checkpoint failed verification: checksum mismatch, unreadable, or non-finite tensors."""


class UnsupportedSetupError(NanGuardError):
    """A training setup nanguard cannot handle correctly; refused at setup instead of guessed at."""


class BundleError(NanGuardError):
    """An incident bundle that cannot be read or replayed: damaged, missing a file or a key, holding a value outside
    the plain types a bundle stores, or naming a class that is no LightningModule. The message says why and what to
    do; nothing the bundle names was run."""


class NanGuardConfigError(ValueError):
    """A constructor argument is invalid. The message names the argument, its value and the rule."""


class NanGuardWarning(UserWarning):
    """Something a run should act on, said while it goes on (a hazard before step 1, an incident training continued
    after). Attributed to the user's line that started the run, so ``warnings.filterwarnings("ignore",
    category=NanGuardWarning)`` silences every one of them."""
