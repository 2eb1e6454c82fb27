"""The Trainer as the replayed step saw it: its own ``global_step`` and ``current_epoch``.

A replay runs after Lightning counted the step (``global_step`` is one ahead by then), and an offline replay has no
Trainer at all. ``seen_at`` gives ``training_step`` a view of the Trainer that reads the step's own counters (online:
everything else is the real Trainer's; nothing of it is changed, ``LightningModule.trainer`` is set back afterwards);
``OfflineTrainer`` is what an offline replay offers instead of a Trainer: the counters and settings the bundle
recorded, and an ``AttributeError`` saying so for anything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl

__all__ = ["OfflineTrainer", "seen_at"]


class _StepView:
    """The real Trainer, but for ``global_step`` and ``current_epoch`` (attribute writes go to the Trainer)."""

    def __init__(self, trainer: object, global_step: int, current_epoch: int) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "global_step", global_step)
        object.__setattr__(self, "current_epoch", current_epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_trainer"), name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(object.__getattribute__(self, "_trainer"), name, value)


@contextlib.contextmanager
def seen_at(pl_module: pl.LightningModule, trainer: object, step: int | None, epoch: int | None) -> Iterator[None]:
    """Within the block, ``pl_module.global_step`` / ``current_epoch`` (and ``self.trainer.global_step``, ...) read
    ``step`` and ``epoch`` (where given); the module's Trainer is set back afterwards."""
    if step is None or not isinstance(trainer, pl.Trainer):
        yield
        return
    epoch = trainer.current_epoch if epoch is None else epoch
    pl_module.trainer = _StepView(trainer, step, epoch)  # type: ignore[assignment]
    try:
        yield
    finally:
        pl_module.trainer = trainer


class OfflineTrainer:
    """What ``training_step`` may read of its Trainer in ``nanguard replay``: the step, epoch and precision the bundle
    recorded, a single process in training, no logger. ``self.log`` is a no-op there (the replay makes it one)."""

    def __init__(self, global_step: int, current_epoch: int, precision: str, precision_plugin: object) -> None:
        self.global_step, self.current_epoch = global_step, current_epoch
        self.precision, self.precision_plugin = precision, precision_plugin
        self.training, self.sanity_checking, self.barebones = True, False, False
        self.world_size, self.num_devices, self.num_nodes = 1, 1, 1
        self.global_rank, self.local_rank, self.node_rank, self.is_global_zero = 0, 0, 0, True
        self.logger: object = None
        self.loggers: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"Trainer.{name}: an offline replay (nanguard replay, replay_bundle) runs the step without a Trainer: "
            "it offers global_step, current_epoch and precision as the bundle recorded them, one process, no logger"
        )
