"""The one way a feature takes part in a step: a part, whose stage methods ``StepFlow`` calls in one fixed order.

A part is any object; it takes part in the stages whose methods it defines, all optional:

1. ``train_start(trainer, pl_module)``: training starts (after the engine's own start: the optimizers, the
   schedulers and a resumed state are in place).
2. ``batch_start(trainer, pl_module, batch, batch_idx) -> bool``: before the batch's forward (after the engine's
   own: the quarantine, AutoRollback's snapshot and triggers). True: the part takes part in this batch's next
   stages (3-5); False: not (the common step: a part with nothing to do costs one call here).
3. ``before_backward(trainer, loss)``: the forward is done (after the engine kept the loss).
4. ``before_optimizer_step(trainer, optimizer)``: the gradients are final (after the engine read the step).
5. ``batch_end(trainer)``: the step is taken (after the engine accounted for it and handled its events).
6. ``train_end(trainer, pl_module)``: training ended (after the engine's end-of-fit check).
7. ``evaluation_start(trainer, pl_module, step_name)``, ``evaluation_epoch_end(trainer, pl_module)``,
   ``evaluation_end(trainer)``: a validation or test loop (``step_name``: ``"validation_step"``, ``"test_step"``).
8. ``metrics(trainer) -> dict[str, float]``: each logging step, into the one logger call.
9. ``summary_lines() -> list[str]``: the end-of-fit summary, after the incidents.

Parts are called in the order they were added (the callbacks' ``setup`` order). A part with nothing to do at a batch
start for now says so with ``engaged`` (False): it is not called then, and the engine's batch start is left out of
Lightning's dispatch while nothing else needs it; a part whose ``engaged`` changes calls
``Engine.refresh_batch_start``. State stays with
the part's callback (``state_dict``: Lightning saves it under the callback's name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_nanguard.engine.capabilities import MetricSource

__all__ = ["STAGES", "Part", "Parts", "Stages"]

STAGES = (
    "train_start",
    "batch_start",
    "before_backward",
    "before_optimizer_step",
    "batch_end",
    "train_end",
    "evaluation_start",
    "evaluation_epoch_end",
    "evaluation_end",
    "metrics",
    "summary_lines",
)


class Part(Protocol):
    """Any object: its stage methods (``STAGES``, the module docstring) are all optional."""


@dataclass(frozen=True)
class Stages:
    """One part's stage methods, looked up once (None: the part does not take part in that stage)."""

    part: object
    train_start: Callable[[pl.Trainer, pl.LightningModule], None] | None
    batch_start: Callable[[pl.Trainer, pl.LightningModule, object, int], bool] | None
    before_backward: Callable[[pl.Trainer, Tensor], None] | None
    before_optimizer_step: Callable[[pl.Trainer, Optimizer], None] | None
    batch_end: Callable[[pl.Trainer], None] | None
    train_end: Callable[[pl.Trainer, pl.LightningModule], None] | None
    evaluation_start: Callable[[pl.Trainer, pl.LightningModule, str], None] | None
    evaluation_epoch_end: Callable[[pl.Trainer, pl.LightningModule], None] | None
    evaluation_end: Callable[[pl.Trainer], None] | None
    metrics: MetricSource | None
    summary_lines: Callable[[], list[str]] | None

    @classmethod
    def of(cls, part: object) -> Stages:
        found = {name: getattr(part, name, None) for name in STAGES}
        return cls(part, **{name: fn if callable(fn) else None for name, fn in found.items()})

    @property
    def engaged(self) -> bool:
        """The part has work at a batch start (its ``engaged``, True where it does not say)."""
        return self.batch_start is not None and bool(getattr(self.part, "engaged", True))


class Parts:
    """The parts of one fit, in the order they were added, and the ones taking part in the batch in flight."""

    def __init__(self) -> None:
        self.all: list[Stages] = []
        self.following: list[Stages] = []  # this batch's: their ``batch_start`` answered True

    def add(self, part: object) -> Stages:
        for stages in self.all:
            if stages.part is part:
                return stages
        stages = Stages.of(part)
        self.all.append(stages)
        return stages

    def with_stage(self, name: str) -> list[Stages]:
        return [s for s in self.all if getattr(s, name) is not None]

    @property
    def engaged(self) -> bool:
        return any(s.engaged for s in self.all)
