"""The callbacks together: one health reading per step, the same run whatever their order, one host read per step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import lightning_nanguard as ng
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import HostReadsPerStep, TinyModel, all_finite, make_trainer, params_of


def _suite() -> list[pl.Callback]:
    # Every incident replayed (a traced replay costs several of this tiny model's millisecond steps: the default
    # budget, in steps' worth of time, would run out at a time-dependent incident).
    monitor = ng.GradNormMonitor(spike_zscore=40.0, spike_warmup=1, on_spike="skip", max_replay_steps=1e9)
    return [monitor, ng.AutoRollback(every_n_steps=2, quiet_steps=0), ng.OptimizerBackoff()]


def _run(
    tmp_path: Any, callbacks: list[pl.Callback]
) -> tuple[dict[str, torch.Tensor], list[tuple[int, str, str]], float]:
    pl.seed_everything(11, verbose=False)
    model = TinyModel()
    trainer = make_trainer(tmp_path, max_steps=12, callbacks=callbacks)
    trainer.fit(model)
    # Each occurrence (a recurring incident is one record with a count), at its record's first step.
    incidents = sorted((i.step, i.action, i.source) for i in get_engine(trainer).sink.records for _ in range(i.count))
    return params_of(model), incidents, trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_order_of_callbacks_does_not_change_the_run(tmp_path: Any, precision: str) -> None:
    # A damaged state (rolled back, no LR cut), then three gradient spikes in a row (skipped; the third backs off).
    inject = [FaultInjector("param", steps=[5]), FaultInjector("grad", steps=[8, 9, 10], value=1e6)]
    forward = _run(tmp_path / "a", [*inject, *_suite()])
    backward = _run(tmp_path / "b", [*_suite()[::-1], *inject[::-1]])
    assert forward[1] == backward[1]
    assert [(s, a) for s, a, _ in forward[1]] == [(5, "rollback"), (8, "skip"), (8, "skip"), (10, "backoff")]
    assert forward[2] == backward[2] == pytest.approx(0.05 * 0.5)
    assert all(torch.equal(forward[0][k], backward[0][k]) for k in forward[0])


def _counts(tmp_path: Any, callbacks: list[pl.Callback], precision: str, model: TinyModel) -> list[int]:
    counter = HostReadsPerStep()
    # Logging every 50 steps and snapshots every 100: these steps are plain healthy steps.
    trainer = make_trainer(tmp_path, precision, max_steps=6, log_every_n_steps=50, callbacks=[*callbacks, counter])
    trainer.fit(model)
    return counter.per_step[1:]


@pytest.mark.parametrize(
    ("precision", "optimizer", "extra"),
    [
        ("32-true", "foreach", 1),  # one read of the reduced [grad norm, loss] vector
        ("bf16-mixed", "foreach", 1),
        ("32-true", "fused", 0),  # the fused optimizer skips on the device from found_inf
        ("16-mixed", "foreach", 0),  # the GradScaler skips on the device: nanguard ORs into its found_inf
    ],
)
def test_host_reads_per_healthy_step(tmp_path: Any, precision: str, optimizer: str, extra: int) -> None:
    suite = [ng.GradNormMonitor(), ng.AutoRollback(every_n_steps=100), ng.OptimizerBackoff(), ng.CheckpointGuard()]
    kw = {"fused": True} if optimizer == "fused" else {}
    plain = _counts(tmp_path / "plain", [], precision, TinyModel(**kw))
    guarded = _counts(tmp_path / "guarded", suite, precision, TinyModel(**kw))
    assert [g - p for p, g in zip(plain, guarded, strict=True)] == [extra] * len(plain)


def test_suite_recovers_a_run_that_dies_without_it(tmp_path: Any) -> None:
    def fit(callbacks: list[pl.Callback]) -> TinyModel:
        model = TinyModel()
        make_trainer(tmp_path, max_steps=12, callbacks=[FaultInjector("param", steps=[6]), *callbacks]).fit(model)
        return model

    assert not all_finite(fit([]))
    assert all_finite(fit(_suite()))


class DispatchedHooks(pl.Callback):
    """Records, at one step, which nanguard callbacks Lightning would dispatch each per-batch hook to."""

    def __init__(self, at_step: int = 2) -> None:
        self.seen: dict[str, list[str]] = {}
        self.taking_part: list[str] = []  # the parts taking part in that batch (``engine/parts.py``)
        self.at_step = at_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            for hook in ("on_train_batch_start", "on_before_optimizer_step", "on_after_backward", "on_train_batch_end"):
                self.seen[hook] = [
                    type(cb).__name__
                    for cb in trainer.callbacks  # type: ignore[attr-defined]
                    if type(cb).__module__.startswith("lightning_nanguard") and callable(getattr(cb, hook))
                ]

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            self.taking_part = [type(part).__name__ for part in get_engine(trainer).taking_part]


def test_lightning_dispatches_the_per_batch_hooks_to_the_driver_only(tmp_path: Any) -> None:
    # Lightning charges a profiler context per hook per callback even for a no-op: the driver's per-batch hooks are
    # the engine's, every other member's are hidden, and a feature's per-step work runs as its part's stages (at step
    # 0 PrecisionHeadroom samples: its part takes part in that whole batch, through the engine).
    probe = DispatchedHooks(at_step=0)
    callbacks = ng.default_callbacks()
    trainer = make_trainer(tmp_path, callbacks=[*callbacks, probe], max_steps=4)
    trainer.fit(TinyModel())
    assert probe.seen["on_after_backward"] == []
    for hook in ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end"):
        assert probe.seen[hook] == ["GradNormMonitor"], hook  # the driver
    assert probe.taking_part == ["PrecisionHeadroom"]
    headroom = next(cb for cb in callbacks if isinstance(cb, ng.PrecisionHeadroom))
    assert headroom.watch.book.modules  # sampled without a hook of its own
    # After the fit every hook is a method again (a later fit, or a user calling it, finds it).
    assert all(callable(cb.on_after_backward) for cb in callbacks)


class _BackOffAt(pl.Callback):
    def __init__(self, backoff: ng.OptimizerBackoff, step: int) -> None:
        self.backoff, self.step = backoff, step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.backoff.back_off(trainer, lr=True, eps=False, cause="test")


def test_optimizer_backoff_takes_part_in_the_batches_while_the_lr_is_backed_off(tmp_path: Any) -> None:
    # Its part re-applies the scale to a scheduler built mid-fit (SWA) and runs the recovery timer: it takes part in
    # no batch while the scale is 1, in every batch from the backoff on; Lightning still dispatches to the driver only.
    before, after = DispatchedHooks(at_step=1), DispatchedHooks(at_step=4)
    callbacks = ng.default_callbacks()
    backoff = next(cb for cb in callbacks if isinstance(cb, ng.OptimizerBackoff))
    trainer = make_trainer(tmp_path, callbacks=[*callbacks, _BackOffAt(backoff, 2), before, after], max_steps=6)
    trainer.fit(TinyModel())
    assert backoff.lr_scale < 1.0
    assert before.taking_part == []
    assert after.taking_part == ["OptimizerBackoff"]
    assert after.seen["on_train_batch_start"] == after.seen["on_train_batch_end"] == ["GradNormMonitor"]
