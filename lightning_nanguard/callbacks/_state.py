"""Where a nanguard callback's state is saved in a checkpoint, and how a resume finds it again.

Lightning saves each callback's ``state_dict`` under its ``state_key`` and, at a resume, loads only the state saved
under the key the callback has now: a key built from an argument that a user changes between runs (a logging depth,
a threshold) makes the resume drop the state with nothing but Lightning's generic "callbacks used to create the
checkpoint need to be provided". So the key holds only what changes the meaning of the saved state. For every
nanguard callback that is nothing: the Trainer holds at most one callback of each kind (``Registry.admit``), and
no argument changes what its state means (quarantined samples, counts, the scales applied, the promoted modules are
the same facts whatever the thresholds or the logging), so the key is the class name.

A checkpoint written before that keyed the state on some arguments (``GradNormMonitor{'on_nonfinite': 'skip',
'layer_depth': 1}``): ``adopt_saved_state`` reads it from there. State that cannot be loaded is reported (a
``NanGuardWarning`` naming the callback and what is lost), never dropped in silence.

State that is malformed (a checkpoint damaged or edited: a wrong type, a missing field, a nesting made to crash a
reader) is a ``CheckpointVerificationError`` naming the callback and the problem, never a traceback from deep inside
its ``load_state_dict``: every nanguard callback's ``load_state_dict`` is wrapped by ``CheckedState``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_nanguard import _notices
from lightning_nanguard.exceptions import CheckpointVerificationError, NanGuardError

__all__ = ["CheckedState", "adopt_saved_state", "saved_state_key", "warn_unloaded_quarantine"]

# What a ``load_state_dict`` raises on a state of the wrong shape (its own validation raises ValueError, a
# NanGuardConfigError included).
_MALFORMED = (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError)


class CheckedState:
    """Mixin of every nanguard callback: the ``load_state_dict`` a subclass defines is wrapped so that a state that
    is not a dict, or that its loading finds malformed, is a ``CheckpointVerificationError`` naming the callback."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("load_state_dict")
        if own is not None and not getattr(own, "nanguard_checked", False):
            cls.load_state_dict = _checked(cls.__qualname__, own)  # type: ignore[attr-defined]


def _checked(name: str, load: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    @functools.wraps(load)
    def load_state_dict(self: object, state_dict: object) -> None:
        problem = "" if isinstance(state_dict, dict) else f"a {type(state_dict).__name__}, not a dict"
        if not problem:
            try:
                load(self, state_dict)
                return
            except NanGuardError:
                raise
            except _MALFORMED as err:
                problem = f"{type(err).__name__}: {str(err)[:300]}"
        raise CheckpointVerificationError(
            f"{name}: the checkpoint's saved state of {name} is malformed ({problem}); resume from another "
            f"checkpoint (nanguard verify lists them), or without {name} (its counts and records then start afresh)."
        )

    load_state_dict.nanguard_checked = True  # type: ignore[attr-defined]
    return load_state_dict


def saved_state_key(callback: Callback) -> str:
    """The key a nanguard callback's state is saved under: its class name (see the module docstring)."""
    return type(callback).__qualname__


def adopt_saved_state(callback: Callback, checkpoint: dict[str, Any]) -> None:
    """At a resume (``on_load_checkpoint``, before Lightning's ``load_state_dict``): where the checkpoint holds this
    callback's state under an older key (the class name and some arguments), put it under the key of now, so that
    Lightning loads it. Several such states (a checkpoint of a run with two callbacks of one kind, from before that
    was refused) cannot be told apart: none is loaded, and the warning says so."""
    states = checkpoint.get("callbacks")
    key = callback.state_key
    if not isinstance(states, dict) or key in states:
        return
    name = type(callback).__qualname__
    older = [k for k in states if isinstance(k, str) and k.startswith(name + "{")]
    if len(older) == 1:
        states[key] = states[older[0]]
    elif older:
        _notices.warn(
            f"{name}: the checkpoint holds {len(older)} states of a {name} ({', '.join(older)}) and this Trainer has "
            f"one: none of them is loaded, so {name} starts this run afresh (its counts, and its quarantine or "
            "scales where it keeps one, are lost). Resume with the checkpoint's callbacks, or start from a "
            "checkpoint of a run with one callback of each kind."
        )


def warn_unloaded_quarantine(owner: str, saved: object) -> None:
    """A saved quarantine that a monitor with ``quarantine=False`` cannot hold: a ``NanGuardWarning`` naming what is
    lost and how to keep it (nothing where the saved one is empty)."""
    if not isinstance(saved, dict):
        return
    held = len(saved.get("samples") or ()) + len(saved.get("fingerprints") or ())
    if held:
        _notices.warn(
            f"{owner}: the checkpoint's quarantine ({held} kept out of training: samples, or batches by fingerprint) "
            f"is not loaded (this {owner} has quarantine=False): that data is trained on again. Resume with "
            f"{owner}(quarantine=True) to keep it out."
        )
