"""Callback objects reused for a new Trainer (k-fold, sweeps) start each fit afresh (issue 24): one fit's quarantine
and budgets must not decide the next. ``quarantine_file`` is the documented way to carry a quarantine over.

Each test runs two ``Trainer.fit`` with the same callback instances and compares the second fit with the first:
the budgets and counts of AutoRollback, LossScaleWatchdog and GradNormMonitor start afresh at each fit (a resume
from a checkpoint restores them: tests/checkpoints and tests/callbacks).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback, GradNormMonitor, LossScaleWatchdog, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer
from tests.regressions.test_quarantine_data_kinds import Recorder, indexed_data


class Fold(Recorder):
    """One fold of a k-fold run: its own data, ``bad`` rows broken."""

    def __init__(self, bad: list[int]) -> None:
        super().__init__()
        self.bad = bad

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*indexed_data(32, bad=self.bad)), batch_size=8)


def _fit(tmp_path: Any, model: pl.LightningModule, callbacks: list[Callback], **kw: Any) -> pl.Trainer:
    trainer = make_trainer(tmp_path, callbacks=callbacks, **{"max_steps": -1, "max_epochs": 2, **kw})
    trainer.fit(model)
    return trainer


def test_a_reused_monitor_starts_each_fit_with_an_empty_quarantine(tmp_path: Any) -> None:
    # Fold 1's sample 13 is broken and quarantined; in fold 2 (other data) sample 13 is healthy and must be trained.
    monitor = GradNormMonitor()
    first = _fit(tmp_path / "1", Fold(bad=[13]), [monitor])
    assert [r.cause for r in get_engine(first).sink.records] == ["input_data"]
    assert monitor.quarantined_samples == [13]
    fold2 = Fold(bad=[])
    second = _fit(tmp_path / "2", fold2, [monitor])
    assert get_engine(second).sink.records == []
    assert monitor.quarantined_samples == []
    assert all(any(13 in batch for batch in batches) for batches in fold2.seen.values())  # trained in every epoch


def test_a_quarantine_file_seeds_every_fit_and_a_fits_own_additions_do_not_carry(tmp_path: Any) -> None:
    seed = os.path.join(tmp_path, "seed.json")
    with open(seed, "w", encoding="utf-8") as f:
        json.dump([2], f)
    monitor = GradNormMonitor(quarantine_file=seed)
    _fit(tmp_path / "1", Fold(bad=[13]), [monitor])
    assert monitor.quarantined_samples == [2, 13]
    fold2 = Fold(bad=[])
    _fit(tmp_path / "2", fold2, [monitor])
    assert monitor.quarantined_samples == [2]
    seen = {i for batches in fold2.seen.values() for batch in batches for i in batch}
    assert 2 not in seen
    assert 13 in seen


def test_a_reused_backoff_starts_at_the_configured_learning_rate(tmp_path: Any) -> None:
    backoff = OptimizerBackoff(triggers="skip", skips_before_backoff=1)
    spikes = {"spike_zscore": 40.0, "spike_warmup": 1, "on_spike": "skip"}  # a gradient spike's remedy: a lower LR
    lrs = []
    for k in (1, 2):
        faults = FaultInjector("grad", steps=[3], value=1e6)
        trainer = _fit(tmp_path / str(k), TinyModel(), [faults, GradNormMonitor(**spikes), backoff])
        lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        assert [r.actions for r in get_engine(trainer).sink.records] == [["skip", "backoff"]]
    assert lrs == [pytest.approx(0.025)] * 2  # halved once in each fit, from 0.05


def test_a_reused_autorollback_has_its_whole_rollback_budget_again(tmp_path: Any) -> None:
    rollback = AutoRollback(every_n_steps=2, quiet_steps=0, max_rollbacks=1)
    for k in (1, 2):
        faults = FaultInjector("param", steps=[4])
        trainer = _fit(tmp_path / str(k), TinyModel(), [faults, GradNormMonitor(), rollback], max_steps=8)
        assert [(r.step, r.actions) for r in get_engine(trainer).sink.records] == [(4, ["rollback"])]


def test_a_reused_watchdog_has_its_whole_collapse_budget_again(tmp_path: Any) -> None:
    watchdog = LossScaleWatchdog(min_scale=1.0, max_overflow_streak=3, on_collapse="warn", max_collapses=1)
    for k in (1, 2):
        faults = FaultInjector("grad", steps=range(2, 6), value="inf")
        with pytest.warns(UserWarning, match="collapse"):
            trainer = _fit(tmp_path / str(k), TinyModel(), [faults, watchdog], max_steps=8, precision="16-mixed")
        collapses = [r.step for r in get_engine(trainer).sink.records if r.trigger == "loss_scale_collapse"]
        assert collapses == [4]


def test_a_reused_monitor_counts_only_this_fits_skipped_steps(tmp_path: Any) -> None:
    monitor = GradNormMonitor()
    for k in (1, 2):
        _fit(tmp_path / str(k), TinyModel(), [FaultInjector("loss", steps=[3]), monitor], max_steps=6)
        assert monitor.skipped_steps == 1


def test_a_reused_monitor_learns_each_fits_spike_statistics_afresh(tmp_path: Any) -> None:
    # The first fit's gradient norms are 1e3 times the second's: carried over, its statistics would see no spike in
    # the second fit's spike, or a spike in its every step.
    monitor = GradNormMonitor(spike_zscore=6.0, spike_warmup=3)
    for k, scale in ((1, 1e3), (2, 1.0)):
        faults = [FaultInjector("grad", steps=range(8), value=scale), FaultInjector("grad", steps=[6], value=1e4)]
        with pytest.warns(UserWarning, match="gradient-norm spike at global_step=6"):
            trainer = _fit(tmp_path / str(k), TinyModel(), [*faults, monitor], max_steps=8)
        assert [(r.step, r.trigger) for r in get_engine(trainer).sink.records] == [(6, "grad_norm_spike")]
        assert monitor.state_dict()["spike"]["grad"]["count"] == 7  # this fit's finite, unspiked steps only


def test_a_resume_still_restores_the_counts_its_checkpoint_holds(tmp_path: Any) -> None:
    # Reset at each fit's setup; a checkpoint's state is loaded after it: resuming carries the counts on, with the
    # same callback instances or new ones.
    monitor = GradNormMonitor(spike_zscore=6.0, spike_warmup=3)
    rollback = AutoRollback(every_n_steps=2, quiet_steps=0)
    faults = [FaultInjector("loss", steps=[2]), FaultInjector("param", steps=[4])]
    first = _fit(tmp_path / "1", TinyModel(), [*faults, monitor, rollback], max_steps=8)  # one epoch
    path = str(tmp_path / "epoch.ckpt")
    first.save_checkpoint(path)
    assert (monitor.skipped_steps, rollback.rollbacks) == (1, 1)
    learned = monitor.state_dict()["spike"]["grad"]["count"]
    for again in (
        [monitor, rollback],
        [GradNormMonitor(spike_zscore=6.0, spike_warmup=3), AutoRollback(every_n_steps=2)],
    ):
        resumed = make_trainer(tmp_path / "2", callbacks=again, max_steps=11)
        resumed.fit(TinyModel(), ckpt_path=path)
        assert (again[0].skipped_steps, again[1].rollbacks) == (1, 1)  # type: ignore[attr-defined]
        assert again[0].state_dict()["spike"]["grad"]["count"] == learned + 3
