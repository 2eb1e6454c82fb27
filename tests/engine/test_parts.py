"""The one way a feature takes part in a step: a part's stages, called by the engine in one fixed order."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

import lightning_nanguard as ng
from lightning_nanguard.engine import Engine
from lightning_nanguard.engine.parts import Parts, Stages
from tests.helpers import TinyModel, make_trainer


class Recorder:
    """A part with every training stage; it takes part in the batches of even steps only."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.calls.append(("train_start", trainer.global_step))

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> bool:
        self.calls.append(("batch_start", trainer.global_step))
        return trainer.global_step % 2 == 0

    def before_backward(self, trainer: pl.Trainer, loss: Tensor) -> None:
        self.calls.append(("before_backward", trainer.global_step))

    def before_optimizer_step(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        self.calls.append(("before_optimizer_step", trainer.global_step))

    def batch_end(self, trainer: pl.Trainer) -> None:
        self.calls.append(("batch_end", trainer.global_step))

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.calls.append(("train_end", trainer.global_step))

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        return {"recorder/calls": float(len(self.calls))}


class _WithPart(ng.LossScaleWatchdog):
    """A member that brings a part (any callback registers its part in ``_install``)."""

    def __init__(self, part: Recorder) -> None:
        super().__init__()
        self.part = part

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        super()._install(trainer, pl_module, engine)
        engine.add_part(self.part)


def test_the_engine_calls_a_parts_stages_in_the_documented_order(tmp_path: Any) -> None:
    part = Recorder()
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=[ng.GradNormMonitor(), _WithPart(part)])
    trainer.fit(TinyModel())
    before_step = ["batch_start", "before_backward", "before_optimizer_step"]
    assert part.calls == [
        ("train_start", 0),
        *[(stage, 0) for stage in before_step],
        ("batch_end", 1),  # the step is taken (global_step counts it) before the batch end
        ("batch_start", 1),  # an odd step: answered False, so no other stage of that batch
        *[(stage, 2) for stage in before_step],
        ("batch_end", 3),
        ("train_end", 3),
    ]


def test_a_part_alone_drives_its_stages(tmp_path: Any) -> None:
    # The member bringing the part drives the fit alone: the engine's batch start is dispatched for the part.
    part = Recorder()
    make_trainer(tmp_path, max_steps=2, callbacks=[_WithPart(part)]).fit(TinyModel())
    assert [name for name, _ in part.calls].count("batch_start") == 2
    assert [name for name, _ in part.calls].count("batch_end") == 1


def test_stages_are_looked_up_once_and_a_part_is_added_once() -> None:
    parts, part = Parts(), Recorder()
    first = parts.add(part)
    assert parts.add(part) is first
    assert len(parts.all) == 1
    assert first.evaluation_start is None
    assert first.summary_lines is None
    assert first.batch_start is not None
    assert Stages.of(object()).engaged is False  # no batch start: nothing to wait for
    assert first.engaged
