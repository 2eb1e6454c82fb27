"""Forensics under DDP (ddp_spawn, gloo, 2 CPU processes): the replay cannot deadlock and every rank agrees."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.engine import get_engine
from tests.forensics.models import BAD_BATCH, BATCH, HandBCE
from tests.helpers import make_trainer


class ShardedBCE(HandBCE):
    """Each rank reads its own shard (``use_distributed_sampler=False``); rank 1's shard holds the saturating row."""

    def __init__(self) -> None:
        super().__init__(hot_rows=(BAD_BATCH * BATCH + 2,))
        clean = HandBCE()
        self.clean_data = (clean.x, clean.y)

    def train_dataloader(self) -> Any:
        if self.global_rank == 1:
            return super().train_dataloader()
        return DataLoader(TensorDataset(*self.clean_data), batch_size=BATCH, shuffle=False)


class DumpDiagnoses(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        records = [
            {**r.diagnosis, "step": r.step, "batch_idx": r.batch_idx, "bundle": r.bundle}
            for r in get_engine(trainer).sink.records
        ]
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump(records, f)


@pytest.mark.distributed
def test_replay_on_both_ranks_same_verdict_naming_the_rank(tmp_path: Any) -> None:
    trainer = make_trainer(
        tmp_path,
        strategy="ddp_spawn",
        devices=2,
        max_steps=4,
        use_distributed_sampler=False,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        callbacks=[GradNormMonitor(), DumpDiagnoses(str(tmp_path))],
    )
    trainer.fit(ShardedBCE())
    per_rank = []
    for r in (0, 1):
        with open(f"{tmp_path}/rank{r}.json") as f:
            per_rank.append(json.load(f))
    [d0], [d1] = per_rank
    assert d0 == d1  # replay_ms included: the slowest rank's time, gathered
    assert (d0["step"], d0["batch_idx"]) == (BAD_BATCH, BAD_BATCH)
    # The origin on rank 1 decides it: log(1 - p) with p = sigmoid(z) saturated at 1.0, the row that triggers it
    # named on its rank (and quarantined there only), the bundle written by rank 1 and named alike on both ranks.
    assert d0["cause"] == "log_of_zero"
    assert d0["ranks"] == [1]
    assert d0["where"].endswith(f"in training_step, rank 1 batch {BAD_BATCH} rows [2]")
    assert d0["origin"]["op"] == "aten.log.default"
    assert d0["origin"]["rank"] == 1
    assert "binary_cross_entropy_with_logits" in d0["hint"]
    assert d0["replayed"]
    assert d0["bundle"].endswith(f"step-{BAD_BATCH}-rank-1")
