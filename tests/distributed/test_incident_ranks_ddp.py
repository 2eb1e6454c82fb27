"""Under DDP an incident names the ranks where it started (README), for a state check too."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_nanguard import AutoRollback
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class DumpIncidents(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        records = [r.to_dict() for r in get_engine(trainer).sink.records]
        with open(os.path.join(self.out_dir, f"incidents-{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(records, f)


@pytest.mark.distributed
def test_a_state_check_names_the_poisoned_rank_only(tmp_path: Any) -> None:
    # Rank 0's weight goes NaN just before a snapshot is due: AutoRollback's check of the state finds it (no step
    # reading is involved), and the incident must name rank 0, not every rank.
    out = str(tmp_path)
    callbacks = [
        FaultInjector("param", steps=[4], ranks=[0]),
        AutoRollback(every_n_steps=2, quiet_steps=0),
        DumpIncidents(out),
    ]
    trainer = make_trainer(tmp_path, strategy="ddp_spawn", devices=2, callbacks=callbacks, max_steps=6)
    trainer.fit(TinyModel())
    seen = []
    for r in (0, 1):
        with open(os.path.join(out, f"incidents-{r}.json"), encoding="utf-8") as f:
            seen.append([(i["step"], i["trigger"], i["ranks"]) for i in json.load(f)])
    assert seen[0] == seen[1] == [(4, "nonfinite_state", [0])]
