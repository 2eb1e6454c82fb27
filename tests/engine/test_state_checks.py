"""The state checks that do not depend on a bad step: the end of fit with any callback, a checkpoint save."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_nanguard as ng
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


@pytest.mark.parametrize(
    "make", [ng.CheckpointGuard, lambda: ng.FP32Evaluation("on_nonfinite")], ids=["CheckpointGuard", "FP32Evaluation"]
)
def test_a_callback_that_watches_no_step_still_never_returns_nonfinite_weights(tmp_path: Any, make: Any) -> None:
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("param", steps=[3]), make()], max_steps=6)
    with pytest.raises(ng.NonFiniteTrainingError, match="training ended with non-finite parameters"):
        trainer.fit(TinyModel())


class BatchNormModel(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh())


class PoisonBuffer(pl.Callback):
    """Writes NaN into a BatchNorm running mean at one step: training-mode BatchNorm uses the batch's statistics,
    so the loss and gradients stay finite and no step check can see it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            pl_module.body[1].running_mean[0] = math.nan


def test_a_nonfinite_buffer_is_found_at_the_next_step_and_rolled_back(tmp_path: Any) -> None:
    """The watched buffers ride in the step's vector: a NaN written at the end of the batch that made global_step 5
    is an incident at the very next step (5), not at the next save (step 8) or the end of fit."""
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    rollback = ng.AutoRollback(every_n_steps=4, quiet_steps=0)  # snapshots at 0, 4, 8
    callbacks = [PoisonBuffer(step=5), ng.GradNormMonitor(), rollback, ng.CheckpointGuard(), saves]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=12, enable_checkpointing=True)
    model = BatchNormModel()
    trainer.fit(model)
    (incident,) = get_engine(trainer).sink.records  # one event, one incident: no refused saves
    assert incident.cause == "corrupt_state"
    assert incident.trigger == "nonfinite_state"
    assert "body.1.running_mean" in incident.where
    assert incident.actions == ["skip", "rollback"]
    assert incident.step == 5  # the next step's reading found it (the save at 8 found nothing left to refuse)
    assert incident.values["restored_from_step"] == 4
    assert all(bool(torch.isfinite(b).all()) for b in model.buffers() if b.is_floating_point())
    assert len(list((tmp_path / "ckpt").glob("*step=*.ckpt"))) == 3  # steps 4, 8, 12: every save went through


class MaskModel(TinyModel):
    """A causal mask of -inf registered as a buffer, as attention code does: a constant, not damage."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.full((4, 4), -math.inf), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.0 * self.mask.softmax(-1).sum()


class NanIntoMask(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == 5:
            pl_module.mask[0, 0] = math.nan


def test_a_buffer_that_holds_infinities_at_the_start_is_intended_and_checked_for_nan_only(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, callbacks=ng.default_callbacks(), max_steps=10)
    trainer.fit(MaskModel())
    assert get_engine(trainer).sink.records == []
    assert get_engine(trainer).ledger.final_state.startswith("finite")
    # A NaN in it is still damage.
    trainer = make_trainer(tmp_path, callbacks=[NanIntoMask(), ng.GradNormMonitor()], max_steps=10)
    with pytest.raises(ng.NonFiniteTrainingError, match="mask"):
        trainer.fit(MaskModel())
