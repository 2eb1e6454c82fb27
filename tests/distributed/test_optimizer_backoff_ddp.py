"""OptimizerBackoff under DDP: a fault on one rank backs off the learning rate identically on every rank."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_nanguard import GradNormMonitor, OptimizerBackoff
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class DumpLR(Callback):
    """Writes each rank's per-step learning rate to ``<dir>/rank<r>.json`` (spawned processes return nothing else)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.lrs, f)


@pytest.mark.distributed
def test_backoff_is_rank_consistent(tmp_path: Any) -> None:
    callbacks = [
        FaultInjector("grad", steps=[1, 2], ranks=[1], value=1e6),  # a gradient spike on rank 1: a lower LR answers it
        GradNormMonitor(spike_zscore=40.0, spike_warmup=1, on_spike="skip"),
        OptimizerBackoff(skips_before_backoff=2),
        DumpLR(str(tmp_path)),
    ]
    trainer = make_trainer(tmp_path, max_steps=5, strategy="ddp_spawn", devices=2, callbacks=callbacks)
    trainer.fit(TinyModel(lr=0.02))
    with open(tmp_path / "rank0.json") as f0, open(tmp_path / "rank1.json") as f1:
        lr0, lr1 = json.load(f0), json.load(f1)
    assert lr0 == lr1
    assert lr0 == pytest.approx([0.02, 0.02, 0.02, 0.01, 0.01])  # the 2nd skip (step 2, rank 1 only) backs off
