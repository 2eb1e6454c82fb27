"""PrecisionHeadroom under DDP (ddp_spawn, gloo, 2 CPU processes): one MAX all-reduce per sample, so the rank whose
outputs are largest decides, and every rank promotes the same module at the same step."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_nanguard import PrecisionHeadroom
from lightning_nanguard.engine import get_engine
from tests.callbacks.test_precision_headroom import ClassHead
from tests.helpers import make_trainer


class Boost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class RankScaledHead(ClassHead):
    """Rank 1's logits are 4x rank 0's (its batches are harder): they reach float16's limit 2 bits (~10 steps)
    earlier."""

    def __init__(self) -> None:
        super().__init__()
        self.boost = Boost()

    def setup(self, stage: str) -> None:
        self.boost.factor = 1.0 + 3.0 * self.trainer.global_rank

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.boost(self.head(self.body(x)))
        centred = logits - logits.mean(-1, keepdim=True)
        return nn.functional.cross_entropy(centred.float(), y)


class Dump(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        records = [i.to_dict() for i in get_engine(trainer).sink.records]
        with open(f"{self.out_dir}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"incidents": records, "nonfinite": pl_module.nonfinite}, f)  # type: ignore[attr-defined]


@pytest.mark.distributed
def test_every_rank_promotes_the_same_module_at_the_same_step(tmp_path: Any) -> None:
    trainer = make_trainer(
        tmp_path,
        "16-mixed",
        strategy="ddp_spawn",
        devices=2,
        max_steps=60,
        callbacks=[PrecisionHeadroom(), Dump(str(tmp_path))],
    )
    trainer.fit(RankScaledHead())
    dumps = []
    for r in (0, 1):
        with open(f"{tmp_path}/rank{r}.json") as f:
            dumps.append(json.load(f))
    promotions = [[(i["step"], i["where"], i["actions"]) for i in d["incidents"]] for d in dumps]
    assert promotions[0] == promotions[1]
    assert [where for _, where, _ in promotions[0]] == ["boost", "head"]  # the boosted logits first
    assert dumps[0]["nonfinite"] == dumps[1]["nonfinite"] == 0  # rank 1, the closer one, never overflowed


@pytest.mark.distributed
def test_every_rank_lowers_the_loss_scale_alike(tmp_path: Any) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_nanguard import LossScaleWatchdog
    from tests.distributed.test_loss_scale_ddp import ScaleDump
    from tests.helpers import TinyModel

    scaler = torch.amp.GradScaler("cpu")  # 65536: the loss-scaled gradient has under 4 bits of headroom there
    trainer = make_trainer(
        tmp_path,
        "16-mixed",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        strategy="ddp_spawn",
        devices=2,
        max_steps=12,
        callbacks=[LossScaleWatchdog(), PrecisionHeadroom(every_n_steps=4), ScaleDump(str(tmp_path))],
    )
    trainer.fit(TinyModel())
    dumps = []
    for r in (0, 1):
        with open(f"{tmp_path}/rank{r}.json") as f:
            dumps.append(json.load(f))
    assert dumps[0]["scales"] == dumps[1]["scales"]
    scales = [scale for _, scale in dumps[0]["scales"]]
    assert scales[0] < 65536.0  # lowered by the first step's trial, before its backward, on both ranks
    assert dumps[0]["incidents"] == dumps[1]["incidents"] == []  # no overflow, and the cut is not an incident


class Shift(nn.Module):
    """``z + offset``, the offset a plain attribute (a buffer would be DDP's rank 0's on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0.0

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.offset


class RankShifted(pl.LightningModule):
    """Targets offset by 4e5 on rank 1 only (its shard's): rank 1's first float16 step overflows in ``denorm``'s
    add, rank 0's does not."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 1)
        self.denorm = Shift()
        self.nonfinite = 0

    def setup(self, stage: str) -> None:
        self.denorm.offset = 4e5 * self.trainer.global_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.denorm(self.body(x)).float() - self.denorm.offset
        loss = nn.functional.mse_loss(pred, y)
        self.nonfinite += not bool(torch.isfinite(loss))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader, TensorDataset

        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


@pytest.mark.distributed
def test_the_first_step_trial_is_decided_alike_on_every_rank(tmp_path: Any) -> None:
    trainer = make_trainer(
        tmp_path,
        "16-mixed",
        strategy="ddp_spawn",
        devices=2,
        max_steps=4,
        callbacks=[PrecisionHeadroom(), Dump(str(tmp_path))],
    )
    trainer.fit(RankShifted())
    dumps = []
    for r in (0, 1):
        with open(f"{tmp_path}/rank{r}.json") as f:
            dumps.append(json.load(f))
    promotions = [[(i["step"], i["where"], i["values"]["op"]) for i in d["incidents"]] for d in dumps]
    assert promotions[0] == promotions[1] == [(0, "denorm", "aten.add")]  # rank 0 follows rank 1's trial
    assert dumps[0]["nonfinite"] == dumps[1]["nonfinite"] == 0
