"""The configurations a demo compares: none, the preset, each callback alone."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.callbacks import Callback

import lightning_nanguard as ng

__all__ = ["CONFIGS", "preset"]


def _stand_in() -> list[Callback]:
    return [
        ng.GradNormMonitor(),
        ng.AutoRollback(),
        ng.OptimizerBackoff(),
        ng.LossScaleWatchdog(),
        ng.CheckpointGuard(),
        ng.FP32Evaluation(),
    ]


# The suite's own preset once it exists; until then the six callbacks at their defaults.
HAS_DEFAULT_CALLBACKS = hasattr(ng, "default_callbacks")


def preset() -> list[Callback]:
    """The six callbacks at cooperative defaults: ``lightning_nanguard.default_callbacks()`` where it exists."""
    if HAS_DEFAULT_CALLBACKS:
        return list(ng.default_callbacks())
    return _stand_in()


# name -> callbacks factory (a fresh list per run: callbacks hold per-fit state).
CONFIGS: dict[str, Callable[[], list[Callback]]] = {
    "unguarded": list,
    "preset": preset,
    "GradNormMonitor": lambda: [ng.GradNormMonitor()],
    "AutoRollback": lambda: [ng.AutoRollback()],
    "OptimizerBackoff": lambda: [ng.OptimizerBackoff()],
    "LossScaleWatchdog": lambda: [ng.LossScaleWatchdog()],
    "CheckpointGuard": lambda: [ng.CheckpointGuard()],
    "FP32Evaluation": lambda: [ng.FP32Evaluation()],
}
