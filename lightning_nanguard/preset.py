"""The whole suite in one line, configured for unattended recovery: ``default_callbacks()``."""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_nanguard._validation import CONFLICTS, check_conflicts
from lightning_nanguard.callbacks import (
    AutoRollback,
    CheckpointGuard,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    OptimizerBackoff,
    PrecisionHeadroom,
)
from lightning_nanguard.exceptions import NanGuardConfigError, brief

__all__ = ["CALLBACKS", "PRESET", "default_callbacks"]

# Each callback's arguments in the preset (the constructors' defaults where not named). Kept in step with
# examples/cli/preset.yaml by a test.
PRESET: dict[type[Callback], dict[str, Any]] = {
    # A spike (3 standard deviations, from the 10th step on) only costs a forward of AutoRollback's probe batch: its
    # loss rose with the spike -> roll back before the climb and lower the LR; it did not -> nothing at all.
    GradNormMonitor: {"spike_zscore": 3.0, "spike_warmup": 10, "on_spike": "probe"},
    AutoRollback: {},
    # A cut learning rate comes back once the schedule itself falls below it (a decay, the end of a warm restart);
    # recovery by time (recover_after) stays off: climbing back into a cause that persists costs more (README,
    # "Remedy cost").
    OptimizerBackoff: {"recover_with_schedule": True},
    LossScaleWatchdog: {},  # on_collapse="auto": a collapse goes to AutoRollback
    # A corrupt resume continues from a verified checkpoint; a checkpoint Lightning wrote without the guard (no
    # sidecar) is checked by its zip CRC-32s, a weights-only load and finiteness instead of being refused.
    CheckpointGuard: {"fallback": True, "require_sidecar": False},
    FP32Evaluation: {"mode": "on_nonfinite", "promote_after": 2},
    # Samples every 50 steps; under 16-mixed a module headed for a float16 overflow runs in float32 before it.
    PrecisionHeadroom: {},
}

# Every nanguard callback, in the preset's order: the one list of them (demos, benchmarks and tests iterate it).
CALLBACKS: tuple[type[Callback], ...] = tuple(PRESET)


def default_callbacks(**overrides: dict[str, Any] | bool) -> list[Callback]:
    """The seven nanguard callbacks, configured to save a run unattended wherever a remedy exists.

    Each keyword is a callback's class name: ``False`` leaves it out (an ablation removes only its remedy), a dict
    overrides some of its arguments, ``True`` keeps the preset.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=default_callbacks(AutoRollback={"every_n_steps": 100}, FP32Evaluation=False))

    Raises:
        NanGuardConfigError: an unknown callback name, or a value that is neither a bool nor a dict; an argument
            outside its rule; a combination that conflicts (``_validation.CONFLICTS``), such as a callback set to
            hand its events to AutoRollback while ``AutoRollback=False``.
    """
    names = {cls.__name__: cls for cls in PRESET}
    for name, value in overrides.items():
        if name not in names:
            raise NanGuardConfigError(f"default_callbacks({name}=...): unknown callback; one of {sorted(names)}.")
        if not isinstance(value, (bool, dict)):
            raise NanGuardConfigError(
                f"default_callbacks({name}={brief(value)}): must be False (leave it out), True, or a dict of arguments."
            )
        if isinstance(value, dict):
            accepted = _arguments(names[name])
            unknown = [key for key in value if key not in accepted]
            if unknown:
                raise NanGuardConfigError(
                    f"default_callbacks({name}={brief(value)}): {name} takes no argument {brief(unknown[0])}; "
                    f"the dict's keys must be among its arguments: {', '.join(accepted)}."
                )
    callbacks: list[Callback] = []
    for cls, kwargs in PRESET.items():
        choice = overrides.get(cls.__name__, True)
        if choice is False:
            continue
        callbacks.append(cls(**{**kwargs, **(choice if isinstance(choice, dict) else {})}))
    # Settings of one callback that need another the overrides leave out (``_validation.CONFLICTS``).
    built = {type(callback).__name__: callback for callback in callbacks}
    involved = {name for conflict in CONFLICTS["default_callbacks"] for name in conflict.args}
    values = {name: _installed_value(built, name) for name in involved}
    check_conflicts("default_callbacks", "default_callbacks", values)
    return callbacks


def _arguments(cls: type) -> list[str]:
    """The keyword arguments ``cls`` takes (its constructor's named parameters)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(cls).parameters.values() if p.kind in kinds]


def _installed_value(built: dict[str, Callback], name: str) -> object:
    """``"AutoRollback"``: whether it is installed; ``"GradNormMonitor.on_spike"``: that argument (``None`` where the
    callback is left out)."""
    owner, _, argument = name.partition(".")
    if not argument:
        return owner in built
    return getattr(built[owner], argument) if owner in built else None
