"""Rank agreement under DDP (ddp_spawn, gloo, 2 CPU processes)."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class DumpPerRank(pl.Callback):
    """Writes each rank's final parameters, skip count and incidents to ``out_dir/rank{r}.*``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        r = trainer.global_rank
        torch.save({n: p.detach().clone() for n, p in pl_module.named_parameters()}, f"{self.out_dir}/rank{r}.pt")
        records = [i.to_dict() for i in get_engine(trainer).sink.records]
        with open(f"{self.out_dir}/rank{r}.json", "w") as f:
            json.dump({"incidents": records}, f)


@pytest.mark.distributed
def test_nan_on_one_rank_is_skipped_on_both(tmp_path: Any) -> None:
    trainer = make_trainer(
        tmp_path,
        strategy="ddp_spawn",
        devices=2,
        max_steps=5,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        callbacks=[FaultInjector("grad", steps=[2], ranks=[1]), GradNormMonitor(), DumpPerRank(str(tmp_path))],
    )
    trainer.fit(TinyModel())
    p0, p1 = torch.load(f"{tmp_path}/rank0.pt"), torch.load(f"{tmp_path}/rank1.pt")
    assert all(torch.equal(p0[k], p1[k]) for k in p0), "ranks diverged: the skip was not collective"
    assert all(bool(torch.isfinite(v).all()) for v in p0.values())
    for r in (0, 1):
        with open(f"{tmp_path}/rank{r}.json") as f:
            incidents = json.load(f)["incidents"]
        assert [(i["step"], i["action"], i["ranks"]) for i in incidents] == [(2, "skip", [1])]
    with open(os.path.join(tmp_path, "csv", "version_0", "nanguard", "incidents.jsonl")) as f:
        assert len(f.readlines()) == 1  # rank 0 alone writes the file
