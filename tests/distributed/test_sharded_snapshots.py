"""Sharded snapshots under DDP: 4 CPU ranks (gloo, ddp_spawn), a 6.3M-parameter MLP with AdamW, two slots.

Each rank keeps a quarter of every snapshot's parameters and optimizer state, so the ring adds half a replica per rank
(two slots) where full snapshots added two replicas; a state damaged on one rank is rolled back on all four, to
exactly the snapshotted state (every rank's chunk gathered back into place, over several all-gather rounds).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import make_trainer

WORLD = 4


class WideMLP(pl.LightningModule):
    """1024 -> 2048 -> 2048 -> 1: 6.3M parameters, 76 MB of parameters and AdamW state (a "full replica")."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(WORLD * 6 * 2, 1024, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=2, shuffle=False)


def _state(pl_module: pl.LightningModule, trainer: pl.Trainer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in pl_module.parameters()]
    for opt in trainer.optimizers:
        for state in opt.state.values():
            tensors.extend(v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


class Probe(pl.Callback):
    """Per rank: the state at the start of batch 2 (snapshotted there), whether the state after batch 3's rollback
    equals it bit for bit, the ring's bytes against a full replica's, the rollbacks and the final parameters."""

    def __init__(self, out_dir: str, rollback: AutoRollback) -> None:
        self.out_dir, self.rollback = out_dir, rollback
        self.at_snapshot: list[torch.Tensor] = []
        self.info: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rollback.ring.gather_bytes = 4 << 20  # 1 MiB per rank and round: 18 all-gather rounds per restore
        self.info["ring_bytes_at_start"] = self.rollback.ring.nbytes()  # allocated at train start, once

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == 2:
            self.at_snapshot = _state(pl_module, trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        if i == 3:
            now = _state(pl_module, trainer)
            self.info["exact"] = len(now) == len(self.at_snapshot) and all(
                torch.equal(a, b) for a, b in zip(now, self.at_snapshot, strict=True)
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        replica = sum(t.numel() * t.element_size() for t in _state(pl_module, trainer))
        records = [r.to_dict() for r in get_engine(trainer).sink.records if r.action == "rollback"]
        self.info.update(
            ring_bytes=self.rollback.ring.nbytes(),
            replica_bytes=replica,
            slots=len(self.rollback.ring.slots),
            rollbacks=[(r["step"], r["values"]["restored_from_step"], r["ranks"]) for r in records],
        )
        torch.save(
            [p.detach().clone() for p in pl_module.parameters()], os.path.join(self.out_dir, f"params-{rank}.pt")
        )
        with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(self.info, f)


@pytest.mark.distributed
def test_four_ranks_keep_half_a_replica_and_roll_back_together(tmp_path: Any) -> None:
    out = str(tmp_path)
    # A budget of 40 MiB per rank holds both sharded slots (18 MB each) where one whole copy (76 MB) would not fit;
    # it is agreed across ranks at every snapshot (an all-reduce).
    rollback = AutoRollback(every_n_steps=2, quiet_steps=0, max_snapshot_bytes=40 * 2**20)
    callbacks = [FaultInjector("param", steps=[3], ranks=[2]), rollback, Probe(out, rollback)]
    trainer = make_trainer(
        tmp_path, strategy="ddp_spawn", devices=WORLD, callbacks=callbacks, max_steps=6, deterministic=False
    )
    trainer.fit(WideMLP())
    ranks = []
    for r in range(WORLD):
        with open(os.path.join(out, f"rank{r}.json"), encoding="utf-8") as f:
            ranks.append(json.load(f))
    for info in ranks:
        # Two slots of a quarter each: half a replica (full snapshots: two replicas). Each tensor starts at a 16-byte
        # boundary in the layout, a few hundred bytes of padding in all.
        assert info["slots"] == 2
        assert info["ring_bytes"] <= 0.5 * info["replica_bytes"] * 1.0001, info
        assert info["ring_bytes_at_start"] == info["ring_bytes"]  # nothing allocated inside the training steps
        # Rank 2's weights were damaged at step 3: every rank restored the step-2 snapshot, bit for bit.
        assert info["rollbacks"] == [[3, 2, [2]]]
        assert info["exact"] is True
    params = [torch.load(os.path.join(out, f"params-{r}.pt"), weights_only=True) for r in range(WORLD)]
    for r in range(1, WORLD):
        assert all(torch.equal(a, b) for a, b in zip(params[0], params[r], strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in params[0])
