"""Data remedies for data faults, and nothing more (issue 24): a bad sample is skipped and quarantined; it never
rolls the state back or lowers the learning rate, however many of them come in a row, and under gradient
accumulation the micro-batch that holds it is found.

Each fit trains on real bad records (a NaN feature) whose rows carry their dataset index in feature 0, so the tests
check which samples were trained on, not only the incident log.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor, OptimizerBackoff, default_callbacks
from lightning_nanguard.engine import get_engine
from tests.helpers import all_finite, make_trainer
from tests.regressions.test_quarantine_data_kinds import Recorder, indexed_data
from tests.regressions.test_rank_consistent import ddp_spawn

LR = 0.05  # Recorder's SGD learning rate


class Shard(Recorder):
    """``n`` rows, ``bad`` of them broken, in order (a corrupt shard keeps its records together)."""

    def __init__(self, n: int, bad: list[int], batch_size: int) -> None:
        super().__init__()
        self.n, self.bad, self.batch_size = n, bad, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*indexed_data(self.n, bad=self.bad)), batch_size=self.batch_size)


def _fit(tmp_path: Any, model: Shard, callbacks: list[Callback], **kw: Any) -> Any:
    trainer = make_trainer(tmp_path, callbacks=callbacks, **{"max_steps": -1, **kw})
    trainer.fit(model)
    assert all_finite(model)
    return trainer


def _trained(model: Recorder, epoch: int) -> set[int]:
    return {i for batch in model.seen[epoch] for i in batch}


def test_a_corrupt_shard_of_consecutive_bad_batches_is_quarantined_never_rolled_back_or_backed_off(
    tmp_path: Any,
) -> None:
    # 25 bad batches in a row (more than max_consecutive_skips=20): each is bad data, and each is quarantined.
    bad = list(range(20, 70))
    model = Shard(n=120, bad=bad, batch_size=2)
    trainer = _fit(tmp_path, model, default_callbacks(), max_epochs=2)
    records = get_engine(trainer).sink.records
    assert [r.cause for r in records] == ["input_data"] * 25
    assert all(r.actions == ["skip", "quarantine"] for r in records)
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR
    assert not _trained(model, 1) & set(bad)  # the second epoch meets none of them again, with no incident


@pytest.mark.parametrize("position", [0, 1, 3])
@pytest.mark.parametrize("suite", ["preset", "monitor"])
def test_a_nan_in_any_micro_batch_of_an_accumulation_window_is_quarantined_without_an_lr_cut(
    tmp_path: Any, position: int, suite: str
) -> None:
    # accumulate_grad_batches=4 and batches of 4: sample 4 * position + 1 sits in micro-batch `position` of step 0.
    sample = 4 * position + 1
    model = Shard(n=64, bad=[sample], batch_size=4)
    callbacks = default_callbacks() if suite == "preset" else [GradNormMonitor(), OptimizerBackoff()]
    trainer = _fit(tmp_path, model, callbacks, max_epochs=4, accumulate_grad_batches=4)
    records = get_engine(trainer).sink.records
    assert [(r.step, r.batch_idx, r.cause, r.actions) for r in records] == [
        (0, position, "input_data", ["skip", "quarantine"])
    ]
    assert records[0].where.endswith("rows [1]")
    monitor = next(c for c in trainer.callbacks if isinstance(c, GradNormMonitor))
    assert monitor.quarantined_samples == [sample]
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR
    assert all(sample not in _trained(model, epoch) for epoch in (1, 2, 3))


class _Outcome(Callback):
    """Each rank's incidents, quarantine and learning rate at the end of fit, as JSON (ddp_spawn's ranks die)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        monitor = next(c for c in trainer.callbacks if isinstance(c, GradNormMonitor))
        records = [
            (r.step, r.batch_idx, str(r.cause), [str(a) for a in r.actions]) for r in get_engine(trainer).sink.records
        ]
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        outcome = {"records": records, "quarantined": monitor.quarantined_samples, "lr": lr}
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(outcome, f)


@pytest.mark.distributed
def test_under_ddp_the_micro_batch_holding_the_nan_is_found_on_its_own_rank(tmp_path: Any) -> None:
    # Two ranks, each every other sample (Lightning's DistributedSampler, unshuffled): sample 10 is rank 0's row 1 of
    # micro-batch 1; rank 1's window is all finite. Every rank decides the same; only rank 0 names the sample.
    model = Shard(n=64, bad=[10], batch_size=4)
    callbacks = [*default_callbacks(), _Outcome(str(tmp_path))]
    trainer = make_trainer(
        tmp_path,
        callbacks=callbacks,
        max_steps=-1,
        max_epochs=2,
        accumulate_grad_batches=4,
        strategy=ddp_spawn(),
        devices=2,
    )
    trainer.fit(model)
    ranks = []
    for rank in (0, 1):
        with open(os.path.join(tmp_path, f"rank{rank}.json"), encoding="utf-8") as f:
            ranks.append(json.load(f))
    assert ranks[0]["records"] == ranks[1]["records"]
    assert [(s, c, a) for s, _, c, a in ranks[0]["records"]] == [(0, "input_data", ["skip", "quarantine"])]
    assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == [10]
    assert ranks[0]["lr"] == ranks[1]["lr"] == LR
