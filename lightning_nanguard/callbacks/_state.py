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
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_nanguard import _notices

__all__ = ["adopt_saved_state", "saved_state_key", "warn_unloaded_quarantine"]


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
