"""The healthy step's fused path (issue 14): the same readings and decisions as the general path, less host work.

``Sensor.quick`` reads a plain single-process step without ``measure``'s layers, the engine accounts for a healthy
batch without ``_account``'s, the driver's hooks are the engine's own methods, a batch start is dispatched only
while it has something to decide, no metric is computed for a fit with no logger, and clipping is guarded only where
Lightning can clip. Each test checks one of these against what it replaces.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

import lightning_nanguard as ng
from lightning_nanguard.engine import get_engine
from lightning_nanguard.engine.sensing import Sensor
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, csv_metrics, make_trainer

BAD_ROW = 13  # sample index of the row whose input is NaN (batch 1 of each epoch, at batch size 8)


class _BadRowModel(TinyModel):
    """TinyModel whose training data has one NaN input row: every epoch it comes back."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        x[BAD_ROW, 3] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def test_the_quick_reading_is_the_general_one(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every step the quick path reads, the general path reads too (both only read the gradients and the loss): the
    # Reading made of the quick values is the general one (values, layout, path), healthy steps and the injected
    # bad one alike; and the logging step's metrics still find the last step's reading.
    pairs: list[tuple[Any, Any]] = []
    quick = Sensor.quick

    def both(self: Sensor, optimizer: Any, losses: list[torch.Tensor], step: int) -> Any:
        values = quick(self, optimizer, losses, step)
        if values is not None:
            trainer = trainers[0]
            general = self.measure(
                trainer, trainer.lightning_module, optimizer, losses, step=step, batch=0, host_only=False
            )
            pairs.append((Sensor.quick_reading(values, 0), general))
        return values

    monkeypatch.setattr(Sensor, "quick", both)
    trainers: list[pl.Trainer] = []
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    monitor = ng.GradNormMonitor()
    trainer = make_trainer(tmp_path, max_steps=8, logger=logger, callbacks=[monitor, FaultInjector("grad", steps=[5])])
    trainers.append(trainer)
    trainer.fit(TinyModel(optimizer="sgd"))
    assert len(pairs) == 7  # every step but the first (its plan is built by the general path)
    for quick_reading, general in pairs:
        for field in ("step", "optimizer_idx", "inline", "path", "has_grads", "scale", "buffers_finite", "bad"):
            assert getattr(quick_reading, field) == getattr(general, field), field
        assert quick_reading.loss == general.loss
        assert quick_reading.grad_norm == pytest.approx(general.grad_norm, rel=1e-12, nan_ok=True)
        torch.testing.assert_close(
            quick_reading.norms.tensor_norms, general.norms.tensor_norms, rtol=0, atol=0, equal_nan=True
        )
    assert [r.step for r, _ in pairs if r.bad] == [5]
    engine = get_engine(trainer)
    assert engine.skipped_steps == 1  # the bad step still went through the general decision
    assert engine.ledger.finite_steps == 7
    last = engine.last_reading  # made from the last step's quick values on first use
    assert last is not None
    assert last.step == 7
    assert last.grad_norm == pytest.approx(pairs[-1][1].grad_norm)
    layers = [k for k in csv_metrics(str(tmp_path / "csv" / "version_0"))[-1] if "layer_grad_norm" in k]
    assert layers  # the per-layer norms of the logging steps, from those readings


class _HookProbe(pl.Callback):
    """At every batch start: whether Lightning dispatches GradNormMonitor's on_train_batch_start."""

    def __init__(self) -> None:
        self.dispatched: list[bool] = []
        self.bound: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, ng.GradNormMonitor))  # type: ignore[attr-defined]
        self.dispatched.append(callable(monitor.on_train_batch_start))
        hook = monitor.on_before_optimizer_step
        self.bound.append(getattr(hook, "__self__", None) is get_engine(trainer))


def test_a_batch_start_is_dispatched_only_once_something_is_quarantined(tmp_path: Any) -> None:
    # GradNormMonitor alone has nothing to decide at a batch start until a sample is quarantined: the hook is hidden
    # (its bookkeeping done at the batch end, where the incident needs it) and shown from the quarantine on, so
    # the bad row is replaced when it comes back and never causes a second incident.
    probe = _HookProbe()
    monitor = ng.GradNormMonitor()
    trainer = make_trainer(tmp_path, max_steps=16, callbacks=[probe, monitor])  # two epochs of 8 batches
    model = _BadRowModel(optimizer="sgd")
    trainer.fit(model)
    incidents = get_engine(trainer).sink.records
    assert [(i.step, i.cause) for i in incidents] == [(1, "input_data")]
    assert monitor.quarantined_samples == [BAD_ROW]
    assert probe.dispatched == [False, False] + [True] * 14  # hidden through the incident's batch, then shown
    assert all(probe.bound)  # the driver's per-batch hooks are the engine's own methods
    assert all_finite(model)
    # After the fit every hook is a method of the callback again.
    assert monitor.on_train_batch_start.__self__ is monitor
    assert monitor.on_before_optimizer_step.__self__ is monitor


def test_a_batch_start_is_dispatched_all_along_with_a_restorer(tmp_path: Any) -> None:
    # AutoRollback's snapshots and triggers run at a batch start: nothing is hidden then.
    probe = _HookProbe()
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[probe, ng.GradNormMonitor(), ng.AutoRollback()])
    trainer.fit(TinyModel(optimizer="sgd"))
    assert probe.dispatched == [True] * 6


def test_no_metric_is_computed_for_a_fit_without_a_logger(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-layer norms of a logging step cost device ops and a host read: not for a fit with nowhere to log.
    calls: list[int] = []
    metrics = ng.GradNormMonitor._metrics

    def counted(self: ng.GradNormMonitor, trainer: pl.Trainer) -> dict[str, float]:
        calls.append(trainer.global_step)
        return metrics(self, trainer)

    monkeypatch.setattr(ng.GradNormMonitor, "_metrics", counted)
    make_trainer(tmp_path / "none", max_steps=6, callbacks=[ng.GradNormMonitor()]).fit(TinyModel())
    assert calls == []
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    make_trainer(tmp_path / "csv", max_steps=6, logger=logger, callbacks=[ng.GradNormMonitor()]).fit(TinyModel())
    assert len(calls) == 6  # log_every_n_steps=1


class _OwnClipping(TinyModel):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kw: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="value")


@pytest.mark.parametrize(
    ("model", "clip", "guarded"),
    [(TinyModel, None, False), (TinyModel, 1.0, True), (_OwnClipping, None, True)],
    ids=["no-clipping", "gradient_clip_val", "own-configure_gradient_clipping"],
)
def test_clipping_is_guarded_only_where_lightning_can_clip(
    tmp_path: Any, model: type[TinyModel], clip: float | None, guarded: bool
) -> None:
    # A dropped update (gradients set to None) must not reach clip_grad_value_ (it raises on the empty list); the
    # guard wraps the precision plugin's clip_gradients, but only where a clip can happen: no wrapper per step else.
    bad = FaultInjector("grad", steps=[2])
    trainer = make_trainer(tmp_path, max_steps=5, gradient_clip_val=clip, callbacks=[ng.GradNormMonitor(), bad])
    fitted = model()
    trainer.fit(fitted)
    assert getattr(trainer.precision_plugin.clip_gradients, "_nanguard_guarded", False) is guarded
    assert get_engine(trainer).skipped_steps == 1
    assert all_finite(fitted)


class _SlowValidation(TinyModel):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.5)
        return super().validation_step(batch, batch_idx)


def test_the_step_clock_does_not_count_validation(tmp_path: Any) -> None:
    # With its batch start hidden, GradNormMonitor times a batch from one batch end to the next: a validation run in
    # between (mid-epoch and at the epoch's end, 0.5 s each here) must not pass for a step of the clock that bounds
    # forensics' replay (a step here takes a few milliseconds).
    trainer = make_trainer(
        tmp_path,
        max_epochs=2,
        max_steps=-1,
        limit_val_batches=1,
        val_check_interval=0.5,
        callbacks=[ng.GradNormMonitor()],
    )
    trainer.fit(_SlowValidation())
    engine = get_engine(trainer)
    assert engine.ledger.finite_steps == 16
    assert 0 < engine.ledger.step_seconds < 0.02, engine.ledger.step_seconds


class _DumpRank(_HookProbe):
    """``_HookProbe`` that writes, at the end of training on each rank, what it saw and what the rank quarantined."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, ng.GradNormMonitor))  # type: ignore[attr-defined]
        out = {
            "dispatched": self.dispatched,
            "quarantined": monitor.quarantined_samples,
            "incidents": [(i.step, i.cause, i.ranks) for i in get_engine(trainer).sink.records],
            "params": [p.detach().flatten().tolist() for p in pl_module.parameters()],
        }
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f)


@pytest.mark.distributed
def test_ddp_ranks_hide_and_show_the_batch_start_together(tmp_path: Any) -> None:
    # Under DDP the bad row reaches one rank's batch; it is quarantined on both ranks (the quarantine is
    # all-gathered), so both show the batch start from the same batch on, and the row never comes back.
    trainer = make_trainer(
        tmp_path,
        strategy="ddp_spawn",
        devices=2,
        max_epochs=3,
        max_steps=-1,
        callbacks=[_DumpRank(str(tmp_path)), ng.GradNormMonitor()],
    )
    trainer.fit(_BadRowModel(optimizer="sgd"))
    ranks = []
    for r in (0, 1):
        with open(os.path.join(tmp_path, f"rank{r}.json"), encoding="utf-8") as f:
            ranks.append(json.load(f))
    [(step, cause, seen_on)] = ranks[0]["incidents"]  # one incident, on the rank whose batch held the row
    assert (cause, ranks[1]["incidents"]) == ("input_data", ranks[0]["incidents"])
    assert len(seen_on) == 1
    hidden_through_the_incident = [False] * (step + 1) + [True] * (11 - step)  # 4 batches per epoch per rank
    assert ranks[0]["dispatched"] == ranks[1]["dispatched"] == hidden_through_the_incident
    assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == [BAD_ROW]
    assert ranks[0]["params"] == ranks[1]["params"]
