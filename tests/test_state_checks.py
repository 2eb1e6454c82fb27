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


def test_a_nonfinite_buffer_is_found_at_the_next_save_and_rolled_back(tmp_path: Any) -> None:
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    rollback = ng.AutoRollback(every_n_steps=4, quiet_steps=0)  # snapshots at 0, 4, 8 (the save at 8 comes first)
    callbacks = [PoisonBuffer(step=5), ng.GradNormMonitor(), rollback, ng.CheckpointGuard(), saves]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=12, enable_checkpointing=True)
    model = BatchNormModel()
    trainer.fit(model)
    (incident,) = get_engine(trainer).sink.records  # one event, one incident: no refused saves
    assert incident.cause == "corrupt_state"
    assert "body.1.running_mean" in incident.where
    assert incident.actions == ["rollback"]
    assert incident.step == 8  # the save at step 8 found it
    assert incident.values["restored_from_step"] == 4
    assert all(bool(torch.isfinite(b).all()) for b in model.buffers() if b.is_floating_point())
    assert len(list((tmp_path / "ckpt").glob("*step=*.ckpt"))) == 3  # steps 4, 8, 12: every save went through
