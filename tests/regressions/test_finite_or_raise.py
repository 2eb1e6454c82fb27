"""Regressions, group A: a fit that returns normally has finite parameters and buffers; otherwise it raises.

One test per script of ``../shared/repros/`` (group A of issue 12), each a real ``Trainer.fit`` on a tiny model.
"""

from __future__ import annotations

import pathlib
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import (
    AutoRollback,
    CheckpointGuard,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    NonFiniteTrainingError,
    OptimizerBackoff,
    verify_checkpoint,
)
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer


def state_finite(module: nn.Module) -> bool:
    """Parameters and floating-point buffers, complex ones through their real view."""
    tensors = [*module.parameters(), *module.buffers()]
    return all(
        bool(torch.isfinite(torch.view_as_real(t) if t.is_complex() else t).all())
        for t in tensors
        if t.is_floating_point() or t.is_complex()
    )


class PoisonAfterUpdate(pl.Callback):
    """Stands for an optimizer update that wrote a NaN into ``head.weight`` at optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step - 1 == self.step:
            head = pl_module.head
            assert isinstance(head, nn.Linear)
            with torch.no_grad():
                head.weight.view(-1)[0] = float("nan")


def save_nan_checkpoint(tmp_path: pathlib.Path) -> pathlib.Path:
    """A checkpoint at the end of epoch 0 (step 8) whose ``body.0.weight`` holds a NaN, saved without nanguard."""
    first = TinyModel()
    plain = make_trainer(tmp_path / "first", max_steps=8)
    plain.fit(first)
    layer = first.body[0]
    assert isinstance(layer, nn.Linear)
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    bad = tmp_path / "bad.ckpt"
    plain.save_checkpoint(str(bad))
    return bad


# repro: autorollback_no_snapshot_silent_nan.py
@pytest.mark.parametrize("every_n_steps", [5, 4])  # step 8 (the resume step) is not / is a snapshot step
def test_resumed_nan_checkpoint_with_nothing_to_restore_raises(tmp_path: pathlib.Path, every_n_steps: int) -> None:
    bad = save_nan_checkpoint(tmp_path)
    model = TinyModel()
    rollback = AutoRollback(every_n_steps=every_n_steps, quiet_steps=2)
    trainer = make_trainer(tmp_path / "resume", callbacks=[rollback], max_steps=20)
    with pytest.raises(NonFiniteTrainingError, match=r"non-finite.*body\.0\.weight") as info:
        trainer.fit(model, ckpt_path=str(bad), weights_only=True)
    assert "do not save or export this model" in str(info.value)
    assert trainer.global_step == 9  # stopped after the first resumed step, not skipping on to max_steps
    records = get_engine(trainer).sink.records
    assert records
    assert all(r.cause == "corrupt_state" for r in records)
    assert all(r.step == 8 for r in records)
    assert "stop" in records[-1].actions
    assert rollback.rollbacks == 0
    assert not all_finite(model)  # what the error is about: the weights really are non-finite


def test_resumed_nan_checkpoint_on_a_snapshot_step_is_one_incident(tmp_path: pathlib.Path) -> None:
    bad = save_nan_checkpoint(tmp_path)
    trainer = make_trainer(tmp_path / "resume", callbacks=[AutoRollback(every_n_steps=4)], max_steps=20)
    with pytest.raises(NonFiniteTrainingError):
        trainer.fit(TinyModel(), ckpt_path=str(bad), weights_only=True)
    records = get_engine(trainer).sink.records
    assert [(r.step, r.cause) for r in records] == [(8, "corrupt_state")]
    assert records[0].actions.count("stop") == 1


# repro: preflight_note_suppresses_first_snapshot.py
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.filterwarnings("ignore:OptimizerBackoff preflight.*eps=1e-08 is 0 in float16")  # 16-true: fixed, not noted
def test_preflight_note_does_not_suppress_the_first_snapshot(tmp_path: pathlib.Path, precision: str) -> None:
    # OptimizerBackoff's preflight note (low-precision parameters without a master copy) is informational; it must
    # not count as an incident for AutoRollback's quiet_steps, so the step-0 snapshot is still taken.
    model = TinyModel()
    rollback = AutoRollback()  # every_n_steps=50, quiet_steps=10: the step-0 snapshot is the only one in this run
    callbacks = [rollback, FaultInjector("param", steps=[6]), OptimizerBackoff()]
    trainer = make_trainer(tmp_path, precision, callbacks=callbacks, max_steps=10)
    trainer.fit(model)
    rollbacks = [r for r in get_engine(trainer).sink.records if "rollback" in r.actions]
    assert [(r.step, r.values["restored_from_step"]) for r in rollbacks] == [(6, 0)]
    assert rollback.rollbacks == 1
    assert all_finite(model)
    assert trainer.global_step == 10


# repro: nan_from_final_update_returned_silently.py
@pytest.mark.filterwarnings("ignore:FP32Evaluation has nothing to do")
def test_nan_written_by_the_last_update_is_not_returned(tmp_path: pathlib.Path) -> None:
    model = TinyModel()
    callbacks = [
        PoisonAfterUpdate(step=7),  # the last update of a max_steps=8 run
        GradNormMonitor(),
        AutoRollback(every_n_steps=3, quiet_steps=1),
        CheckpointGuard(),
        OptimizerBackoff(),
        LossScaleWatchdog(),
        FP32Evaluation("on_nonfinite"),
        ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_last=True),
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=8)
    trainer.fit(model)
    assert state_finite(model)
    # The step-8 save checked the state on every rank, rolled it back before writing: the save went through.
    (final,) = [r for r in get_engine(trainer).sink.records if r.action == "rollback"]
    assert final.step == 8
    assert final.values["restored_from_step"] == 6
    assert "head.weight" in final.where
    assert not [r for r in get_engine(trainer).sink.records if r.action == "refuse"]


def test_nan_from_the_last_update_without_a_restorer_raises(tmp_path: pathlib.Path) -> None:
    model = TinyModel()
    trainer = make_trainer(tmp_path, callbacks=[PoisonAfterUpdate(step=5), GradNormMonitor()], max_steps=6)
    with pytest.raises(NonFiniteTrainingError, match=r"head\.weight"):
        trainer.fit(model)
    assert not all_finite(model)


class TinyBN(TinyModel):
    """TinyModel with a BatchNorm1d: its running statistics are updated by the forward pass, before any check."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())


# repro: gradnormmonitor_skip_leaves_batchnorm_nan.py
def test_skipped_nan_batch_with_batchnorm_nan_stops_instead_of_training_on(tmp_path: pathlib.Path) -> None:
    # The forward pass of the NaN batch already wrote NaN into the running statistics; dropping the update cannot
    # undo that, and without AutoRollback nothing can: the fit must say so, not return a model that evaluates to NaN.
    model = TinyBN()
    callbacks = [
        FaultInjector("input", steps=[3]),
        GradNormMonitor(),
        CheckpointGuard(),
        ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, save_top_k=1),
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=8)
    with (
        pytest.raises(NonFiniteTrainingError, match=r"body\.1\.running_mean, body\.1\.running_var") as info,
        pytest.warns(UserWarning, match="CheckpointGuard refused to write"),
    ):
        trainer.fit(model)
    assert "do not save or export this model" in str(info.value)
    assert "dropped the update" in str(info.value)
    assert trainer.global_step == 4  # stopped after the bad step, not 4 more steps on NaN statistics
    records = get_engine(trainer).sink.records
    assert [(r.step, r.cause, r.actions) for r in records] == [
        (3, "corrupt_state", ["skip", "quarantine", "stop"]),  # the batch that poisoned the buffers is quarantined
        (4, "corrupt_state", ["refuse"]),  # CheckpointGuard kept the NaN statistics off disk
    ]
    assert not state_finite(model)


def test_skipped_nan_batch_with_autorollback_restores_batchnorm_statistics(tmp_path: pathlib.Path) -> None:
    model = TinyBN()
    callbacks = [FaultInjector("input", steps=[3]), GradNormMonitor(), AutoRollback(every_n_steps=2, quiet_steps=0)]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=8, limit_val_batches=2)
    trainer.fit(model)
    assert state_finite(model)
    assert trainer.global_step == 8
    (incident,) = get_engine(trainer).sink.records
    assert (incident.step, incident.action, incident.values["restored_from_step"]) == (3, "rollback", 2)
    assert "body.1.running_mean" in incident.where
    val = trainer.validate(model, verbose=False)
    assert torch.isfinite(torch.tensor(val[0]["val_loss"]))


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers: the generator steps first (global_step 2k), the discriminator second."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = cast(list[LightningOptimizer], self.optimizers())
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.gen(torch.randn(real.shape[0], 4))
        g_loss = bce(self.disc(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = bce(self.disc(real), ones) + bce(self.disc(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)]

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g)), batch_size=8)


# repro: manual_opt_first_optimizer_nan_unreported.py
@pytest.mark.parametrize(("step", "who"), [(6, "gen"), (7, "disc")])
def test_manual_optimization_reports_a_nan_step_of_either_optimizer(
    tmp_path: pathlib.Path, step: int, who: str
) -> None:
    model = GAN()
    snoop = UpdateSpy(step, who)
    callbacks = [FaultInjector("loss", steps=[step]), snoop, AutoRollback(every_n_steps=4, quiet_steps=1)]
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = make_trainer(tmp_path, callbacks=callbacks, logger=logger, max_steps=12)
    trainer.fit(model)
    records = get_engine(trainer).sink.records
    assert [(r.step, r.trigger) for r in records] == [(step, "nonfinite_loss_and_grads")]
    assert "skip" in records[0].actions
    assert snoop.unchanged  # the NaN update of that optimizer was dropped, not applied
    assert state_finite(model)
    summary = (tmp_path / "csv" / "version_0" / "nanguard" / "summary.txt").read_text()
    assert "incidents: 1" in summary
    assert "every training step was checked and was finite" not in summary


class UpdateSpy(pl.Callback):
    """Whether the ``who`` module's parameters were left unchanged by the batch that holds optimizer step ``step``."""

    def __init__(self, step: int, who: str) -> None:
        self.step, self.who, self.unchanged = step, who, False
        self._before: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = {n: p.detach().clone() for n, p in getattr(pl_module, self.who).named_parameters()}
        self._in_window = trainer.global_step in (self.step, self.step - 1)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._in_window:
            after = dict(getattr(pl_module, self.who).named_parameters())
            self.unchanged = all(torch.equal(self._before[n], after[n]) for n in self._before)


class Spectral(pl.LightningModule):
    """A complex-valued weight (spectral layers, complex nets), trained by Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4, dtype=torch.cfloat) * 0.1)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head((x.to(torch.cfloat) @ self.w).abs()), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return TinyModel().train_dataloader()


# repro: complex_param_nan_checkpoint_verified.py
def test_complex_nan_weight_is_never_checkpointed_nor_returned(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    callbacks = [
        FaultInjector("param", steps=[6], param_name="w"),
        GradNormMonitor(max_consecutive_skips=100),
        CheckpointGuard(),
        ModelCheckpoint(dirpath=str(ck), every_n_train_steps=4, save_top_k=-1),
    ]
    model = Spectral()
    trainer = make_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=12)
    with pytest.raises(NonFiniteTrainingError, match=r"corrupt state at w\b"):
        trainer.fit(model)
    assert not state_finite(model)
    for path in ck.glob("*.ckpt"):  # every file that verifies holds a finite complex weight
        w = torch.load(path, weights_only=True)["state_dict"]["w"]
        finite = bool(torch.isfinite(torch.view_as_real(w)).all())
        assert finite or not verify_checkpoint(str(path)).ok, path.name
    good = [p.name for p in ck.glob("epoch=*.ckpt") if verify_checkpoint(str(p)).ok]
    assert good == ["epoch=0-step=4.ckpt"]


def test_complex_nan_weight_with_autorollback_is_restored(tmp_path: pathlib.Path) -> None:
    model = Spectral()
    callbacks = [FaultInjector("param", steps=[6], param_name="w"), AutoRollback(every_n_steps=2, quiet_steps=0)]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=10)
    trainer.fit(model)
    assert state_finite(model)
    rollbacks = [r for r in get_engine(trainer).sink.records if "rollback" in r.actions]
    assert [(r.step, r.values["restored_from_step"]) for r in rollbacks] == [(6, 4)]
