"""LossScaleWatchdog under DDP (ddp_spawn, gloo, 2 CPU processes): every rank floors, collapses and stops together."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_nanguard import LossScaleWatchdog
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class ScaleDump(pl.Callback):
    """Writes each rank's scale after every batch and its incidents to ``out_dir/rank{r}.json``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.scales: list[list[float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # Written every batch: the stop error at on_train_end may end the other worker before it could write.
        self.scales.append([trainer.global_step, trainer.precision_plugin.scaler.get_scale()])
        records = [i.to_dict() for i in get_engine(trainer).sink.records]
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"scales": self.scales, "incidents": records}, f)


@pytest.mark.distributed
def test_ranks_floor_and_stop_together(tmp_path: Any) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    watchdog = LossScaleWatchdog(min_scale=256.0, floor_patience=2, max_overflow_streak=None, on_collapse="stop")
    trainer = make_trainer(
        tmp_path,
        "16-mixed",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy="ddp_spawn",
        devices=2,
        max_steps=12,
        callbacks=[FaultInjector("grad", steps=range(1, 12), value="inf"), watchdog, ScaleDump(str(tmp_path))],
    )
    with pytest.raises(Exception, match=r"loss-scale collapse.*global_step=4"):  # re-raised from the workers
        trainer.fit(TinyModel())
    dumps = []
    for r in (0, 1):
        with open(f"{tmp_path}/rank{r}.json") as f:
            dumps.append(json.load(f))
    assert dumps[0]["scales"] == dumps[1]["scales"] == [[1, 1024.0], [2, 512.0], [3, 256.0], [4, 256.0], [5, 256.0]]
    for d in dumps:
        collapses = [i for i in d["incidents"] if i["trigger"] == "loss_scale_collapse"]
        assert [(i["step"], i["action"], i["ranks"]) for i in collapses] == [(4, "stop", [0, 1])]
        assert "2 overflowing steps with the scale already at its floor min_scale=256" in collapses[0]["message"]
