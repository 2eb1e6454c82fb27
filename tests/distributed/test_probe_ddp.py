"""The probe under ddp_spawn (2 CPU processes, gloo): each rank scores its own probe rows, one all-reduce, one verdict."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard import AutoRollback, GradNormMonitor, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class DumpPerRank(pl.Callback):
    """Writes each rank's final parameters, incidents and probe scores to ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        torch.save(
            {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            os.path.join(self.out_dir, f"params-{rank}.pt"),
        )
        records = [
            (r.step, str(r.trigger), str(r.cause), r.diagnosis["evidence"][0]) for r in get_engine(trainer).sink.records
        ]
        rollback = next(c for c in trainer.callbacks if isinstance(c, AutoRollback))  # type: ignore[attr-defined]
        with open(os.path.join(self.out_dir, f"probe-{rank}.json"), "w", encoding="utf-8") as f:
            json.dump({"records": records, "scores": rollback.probe.book.scores}, f)


@pytest.mark.distributed
def test_every_rank_reads_the_same_probe_and_rolls_back_together(tmp_path: Any) -> None:
    out = str(tmp_path)
    callbacks = [
        FaultInjector("grad", steps=[14], value=300.0),  # one update 300x too large: the weights, not the batch
        GradNormMonitor(spike_zscore=3.0, spike_warmup=5, on_spike="probe", forensics="off"),
        AutoRollback(every_n_steps=5, quiet_steps=0),
        OptimizerBackoff(),
        DumpPerRank(out),
    ]
    trainer = make_trainer(tmp_path, strategy="ddp_spawn", devices=2, callbacks=callbacks, max_steps=20)
    trainer.fit(TinyModel(optimizer="sgd", lr=0.05))
    seen = []
    for r in (0, 1):
        with open(os.path.join(out, f"probe-{r}.json"), encoding="utf-8") as f:
            seen.append(json.load(f))
    assert seen[0] == seen[1]  # the same scores (reduced), the same incidents, the same evidence
    records = seen[0]["records"]
    assert records, seen[0]
    step, trigger, cause, evidence = records[0]
    assert (trigger, cause, evidence["kind"]) == ("probe_rose", "weights_diverging", "probe_loss"), records
    assert step >= 14  # at or after the oversized update, never before
    # Like with like: the reference snapshot (its bytes spread over the ranks) was loaded on both ranks together and
    # scored at the spike, beside the current weights.
    assert evidence["probe_same_moment"] is True, evidence
    p0, p1 = (torch.load(os.path.join(out, f"params-{r}.pt"), weights_only=True) for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert all(bool(torch.isfinite(v).all()) for v in p0.values())
