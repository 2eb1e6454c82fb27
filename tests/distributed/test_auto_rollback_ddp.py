"""AutoRollback under ddp_spawn (2 CPU processes, gloo): a NaN on rank 1 only rolls both ranks back together."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard import AutoRollback
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class DumpPerRank(pl.Callback):
    """Writes each rank's final parameters and rollback incidents to ``out_dir`` (spawned ranks cannot return them)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(params, os.path.join(self.out_dir, f"params-{rank}.pt"))
        records = [r.to_dict() for r in get_engine(trainer).sink.records if r.action == "rollback"]
        with open(os.path.join(self.out_dir, f"rollbacks-{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(records, f)


@pytest.mark.distributed
def test_nan_on_one_rank_rolls_back_every_rank_to_the_same_snapshot(tmp_path: Any) -> None:
    out = str(tmp_path)
    callbacks = [
        FaultInjector("param", steps=[3], ranks=[1]),  # rank 1's weights are damaged: every rank restores
        AutoRollback(every_n_steps=2, quiet_steps=0),
        DumpPerRank(out),
    ]
    trainer = make_trainer(tmp_path, strategy="ddp_spawn", devices=2, callbacks=callbacks, max_steps=6)
    trainer.fit(TinyModel())
    done = []
    for r in (0, 1):
        with open(os.path.join(out, f"rollbacks-{r}.json"), encoding="utf-8") as f:
            done.append([(i["step"], i["values"]["restored_from_step"], i["ranks"]) for i in json.load(f)])
    assert done[0] == done[1] == [(3, 2, [1])]  # one reduced decision: same step, same snapshot, rank 1 named
    p0, p1 = (torch.load(os.path.join(out, f"params-{r}.pt"), weights_only=True) for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert all(bool(torch.isfinite(v).all()) for v in p0.values())
