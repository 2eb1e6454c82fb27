"""How nanguard tells the user something while a run goes on: one of two ways, on rank 0 only.

* ``warn``: something to act on (a hazard found before step 1, an incident training went on after, a setting that
  does nothing where it was asked for explicitly). A ``NanGuardWarning`` (a ``UserWarning``) attributed to the user's
  line that started the run (``trainer.fit(...)``), not to a file inside nanguard or Lightning, so that it reads
  ``train.py:42: NanGuardWarning: ...`` and is filtered by category
  (``warnings.filterwarnings("ignore", category=NanGuardWarning)``).
* ``note``: a fact with nothing to do (a callback idle in this precision, a note about the setup, the summary). A
  plain line through Lightning's logger, as Lightning's own ``Trainer.fit stopped: ...`` lines.

Both start with who says it (``FP32Evaluation ...``, ``OptimizerBackoff preflight: ...``, ``nanguard: ...``).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import warnings

from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from lightning_nanguard.exceptions import NanGuardWarning

__all__ = ["note", "warn"]


def _package_dirs() -> tuple[str, ...]:
    """Where nanguard and the packages between the user's call and a notice live (found, not imported)."""
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    for name in ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torch", "deepspeed"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            dirs.extend(os.path.abspath(d) for d in spec.submodule_search_locations or [])
    return tuple(d + os.sep for d in dirs)


_INTERNAL = _package_dirs()


def warn(message: str) -> None:
    """A ``NanGuardWarning`` on rank 0, attributed to the first frame outside nanguard, Lightning and torch."""
    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    warnings.warn(message, NanGuardWarning, stacklevel=_user_stacklevel())


def note(message: str) -> None:
    """A plain line on rank 0, through Lightning's logger."""
    rank_zero_info(message)


def _user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` called in ``warn``: the user's frame (``2``, ``warn``'s caller, when
    every frame is internal)."""
    frame = inspect.currentframe()
    level, found = 0, 0
    while frame is not None:
        level += 1
        if level > 2 and not os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
            found = level - 1  # counted from _user_stacklevel; warnings.warn's stacklevel counts from warn
            break
        frame = frame.f_back
    return found if found else 2
