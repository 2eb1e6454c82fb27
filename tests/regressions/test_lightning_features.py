"""Regressions, group D: Lightning features keep working with nanguard installed.

One test per script of ``../shared/repros/`` (group D of issue 12), each a real ``Trainer.fit`` on a tiny model.
"""

from __future__ import annotations

import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_nanguard import AutoRollback, CheckpointGuard, GradNormMonitor, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.preset import CALLBACKS
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, loggers, make_trainer


# repro: skip_crashes_gradient_clip_value.py
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("callback", [GradNormMonitor, AutoRollback])
def test_a_dropped_update_keeps_gradient_clipping_working(
    tmp_path: pathlib.Path, precision: str, algorithm: str, callback: type[pl.Callback]
) -> None:
    # A skip leaves every grad None; Lightning clips after nanguard's hook: clip_grad_value_ on no gradients raised.
    model = TinyModel()
    trainer = make_trainer(
        tmp_path,
        precision,
        callbacks=[FaultInjector("loss", steps=[3]), callback()],
        gradient_clip_val=1.0,
        gradient_clip_algorithm=algorithm,
        max_steps=6,
    )
    trainer.fit(model)
    assert trainer.global_step == 6
    assert [(r.step, r.action) for r in get_engine(trainer).sink.records] == [(3, "skip")]
    assert all_finite(model)


class DataloaderIterModel(TinyModel):
    """``training_step(self, dataloader_iter)``: Lightning needs ``batch_size`` in every ``self.log`` call."""

    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.automatic_optimization = not manual

    def training_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return None


# repro: dataloader_iter_step_crashes_on_log.py
@pytest.mark.filterwarnings("ignore:.*dataloader_iter.*")
@pytest.mark.filterwarnings("ignore:FP32Evaluation has nothing to do")
@pytest.mark.filterwarnings("ignore:LossScaleWatchdog does nothing")
@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("callback", CALLBACKS)
def test_dataloader_iter_training_step_fits_with_each_callback(
    tmp_path: pathlib.Path, callback: type[pl.Callback], manual: bool
) -> None:
    # log_every_n_steps=1 and real loggers: every step is a logging step, where a `self.log` without batch_size
    # raised MisconfigurationException under the dataloader_iter flavour. The step watchers also see one NaN step,
    # so the incident path (its metrics and TensorBoard text) runs under this flavour too.
    watches = callback in (GradNormMonitor, AutoRollback)
    model = DataloaderIterModel(manual)
    callbacks = [callback(), *([FaultInjector("loss", steps=[2])] if watches else [])]
    trainer = make_trainer(tmp_path, callbacks=callbacks, logger=loggers(tmp_path), max_steps=4, log_every_n_steps=1)
    trainer.fit(model)
    assert trainer.global_step == 4
    assert len(model.losses) == 4
    assert [(r.step, r.action) for r in get_engine(trainer).sink.records] == ([(2, "skip")] if watches else [])
    assert all_finite(model)


# repro: missing_ckpt_not_filenotfounderror.py
@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_missing_ckpt_path_is_file_not_found_with_checkpoint_guard(tmp_path: pathlib.Path, stage: str) -> None:
    model = TinyModel()
    model.test_step = model.validation_step  # type: ignore[method-assign]
    model.test_dataloader = model.val_dataloader  # type: ignore[method-assign]
    model.predict_dataloader = model.val_dataloader  # type: ignore[method-assign]
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], limit_val_batches=1)
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt"):  # `except FileNotFoundError` keeps working
        getattr(trainer, stage)(model, ckpt_path=str(tmp_path / "missing.ckpt"))
    assert model.losses == []


class LRTrace(pl.Callback):
    """The first param group's learning rate after every optimizer step."""

    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


# repro: optimizer_backoff_undone_by_swa.py
def test_optimizer_backoff_survives_stochastic_weight_averaging(tmp_path: pathlib.Path) -> None:
    # 8 steps an epoch; SWA from epoch 2 anneals to swa_lrs within one epoch. The backoff at step 20 (epoch 2) must
    # hold through SWALR's later epochs: SWALR anneals towards group["swa_lr"], which the backoff scales too.
    trace, backoff = LRTrace(), OptimizerBackoff(triggers="skip", skips_before_backoff=1)
    callbacks = [
        FaultInjector("grad", steps=[20], value=1e12),  # a gradient spike, skipped: its remedy is a lower LR
        GradNormMonitor(spike_zscore=20.0, spike_warmup=5, on_spike="skip"),
        backoff,
        trace,
        StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=1),
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_epochs=5, max_steps=-1)
    trainer.fit(TinyModel())
    assert trainer.global_step == 40
    (incident,) = get_engine(trainer).sink.records
    assert incident.step == 20
    assert "backoff" in incident.actions
    assert backoff.lr_scale == 0.5
    assert trace.lr[16] == pytest.approx(0.01)  # SWA's rate before the backoff: 0.01
    assert trace.lr[24] == pytest.approx(0.005)  # SWALR's next epoch: still backed off
    assert trace.lr[40] == pytest.approx(0.005)  # and at the end
    assert all(lr <= 0.005 + 1e-12 for step, lr in trace.lr.items() if step > 20)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_a_fitted_trainer_is_freed_with_its_model(tmp_path: pathlib.Path, precision: str) -> None:
    # Several fits in one process (a sweep, a notebook): each Trainer, with its model, optimizer state and data, must
    # be freed once the user drops it. A module-level map from Trainer to engine kept every one alive, since the
    # engine refers back to the Trainer through its members.
    import gc
    import weakref

    from lightning_nanguard import default_callbacks

    def fit() -> tuple[weakref.ref[Any], weakref.ref[Any]]:
        model = TinyModel()
        trainer = make_trainer(tmp_path, precision, callbacks=default_callbacks(), limit_val_batches=2)
        trainer.fit(model)
        get_engine(trainer)  # what a user or a test reads after the fit
        return weakref.ref(trainer), weakref.ref(model)

    refs = [fit() for _ in range(2)]
    gc.collect()
    assert [(t() is None, m() is None) for t, m in refs] == [(True, True)] * 2
