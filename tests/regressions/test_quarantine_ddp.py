"""Under DDP a quarantined batch's update is dropped on every rank or on none (issue 25).

A batch quarantined by fingerprint comes back on one rank only (each rank has its own batches): the ranks must agree
on the drop, or the rank that drops stops stepping while the others go on, and the replicas diverge.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.engine import get_engine
from lightning_nanguard.recovery.quarantine import fingerprint
from tests.helpers import TinyModel, make_trainer
from tests.regressions.test_rank_consistent import ddp_spawn

BATCH, PER_RANK = 8, 4


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * BATCH * PER_RANK, 8, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2] * 0.25


def _indices(rank: int, b: int) -> list[int]:
    base = rank * BATCH * PER_RANK + b * BATCH
    return list(range(base, base + BATCH))


class RankBatches(Sampler[list[int]]):
    """A custom batch sampler (no torch BatchSampler: no sample indices), each rank its own batches."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[list[int]]:
        return iter(_indices(self.rank, b) for b in range(PER_RANK))

    def __len__(self) -> int:
        return PER_RANK


class RankModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*_data()), batch_sampler=RankBatches(self.trainer.global_rank))


class Dump(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = get_engine(trainer)
        assert engine.registry.quarantine is not None
        torch.save(
            {n: p.detach().clone() for n, p in pl_module.named_parameters()}, f"{self.out}/p{trainer.global_rank}.pt"
        )
        state = {"quarantine": engine.registry.quarantine.state_dict(), "incidents": len(engine.sink.records)}
        state["skipped"] = engine.skipped_steps
        with open(f"{self.out}/q{trainer.global_rank}.json", "w", encoding="utf-8") as f:
            json.dump(state, f)


# repro: ddp_fingerprint_quarantine_rank_local_drop_diverges.py
@pytest.mark.distributed
def test_a_batch_quarantined_by_fingerprint_is_dropped_on_every_rank_or_none(tmp_path: pathlib.Path) -> None:
    # Rank 1's batch 2, quarantined by fingerprint (a seed file), comes back each epoch on rank 1 only.
    x, y = _data()
    rows = _indices(1, 2)
    seed = os.path.join(tmp_path, "seed.json")
    with open(seed, "w", encoding="utf-8") as f:
        json.dump({"fingerprints": [fingerprint([x[rows], y[rows]])]}, f)
    callbacks = [GradNormMonitor(quarantine_file=seed), Dump(str(tmp_path))]
    trainer = make_trainer(
        tmp_path,
        strategy=ddp_spawn(),
        devices=2,
        callbacks=callbacks,
        max_steps=-1,
        max_epochs=3,
        use_distributed_sampler=False,
    )
    trainer.fit(RankModel())
    p0, p1 = (torch.load(tmp_path / f"p{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(p0[n], p1[n]) for n in p0)  # the replicas never diverged
    states = [json.loads((tmp_path / f"q{r}.json").read_text()) for r in (0, 1)]
    assert states[0] == states[1]
    assert (states[0]["quarantine"]["dropped_batches"], states[0]["skipped"], states[0]["incidents"]) == (3, 3, 0)
