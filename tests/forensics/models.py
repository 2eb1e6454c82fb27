"""Tiny models whose numerics fail by a real mechanism at a chosen batch (no injected NaN), for forensics tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BAD_BATCH = 2  # the batch (and the optimizer step: one batch per step) where each mechanism strikes
BATCH = 8


def _x(n: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


class _Base(pl.LightningModule):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, lr: float = 0.01, optimizer: str = "sgd", **kw: Any):
        super().__init__()
        self.x, self.y, self.lr, self.optimizer_name, self.opt_kw = x, y, lr, optimizer, kw

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, **self.opt_kw)
        return torch.optim.SGD(self.parameters(), lr=self.lr, **self.opt_kw)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=False)


class PowerFeatures(nn.Module):
    """An un-normalised second-order feature (x * x): fine in float32, past ~256 it overflows float16's 65504."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class OverflowNet(_Base):
    """Regression whose ``power`` layer overflows in fp16 on a batch at 1000x the usual input scale."""

    def __init__(self, bad_batches: tuple[int, ...] = (BAD_BATCH,), **kw: Any) -> None:
        x = _x()
        for b in bad_batches:
            x[b * BATCH : (b + 1) * BATCH] *= 1000.0  # a whole shard at another scale: not an outlier row
        super().__init__(x, x[:, :1] * 0.5, **kw)
        self.encoder = nn.Linear(8, 16)
        self.power = PowerFeatures()
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.power(self.encoder(x))).float(), y.float())


class RegressionNet(_Base):
    """A plain MLP regression; ``bad_rows`` get NaN inputs."""

    def __init__(self, bad_rows: tuple[int, ...] = (), n: int = 48, **kw: Any) -> None:
        x = _x(n)
        for r in bad_rows:
            x[r, 3] = float("nan")
        super().__init__(x, x[:, :1] * 0.5 - x[:, 1:2] * 0.25, **kw)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.body(x)).float(), y.float())


class SoftTargetClassifier(_Base):
    """A 5-class head trained on normalised one-hot targets; labels >= 5 make an all-zero row and 0/0 = NaN."""

    classes = 5

    def __init__(self, bad_label_rows: tuple[int, ...] = (), **kw: Any) -> None:
        x = _x()
        y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()  # labels 0..3
        for r in bad_label_rows:
            y[r] = 9  # the dataset uses 10 classes, the head has 5
        super().__init__(x, y, **kw)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, self.classes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logp = torch.log_softmax(self.head(self.body(x)).float(), dim=-1)
        target = (y[:, None] == torch.arange(self.classes, device=y.device)).float()
        target = target / target.sum(-1, keepdim=True)  # label smoothing-ready soft targets
        return -(target * logp).sum(-1).mean()


class HandBCE(_Base):
    """Binary classifier with a hand-written BCE: a saturated sigmoid gives p == 1.0 and log(1 - p) = log(0)."""

    def __init__(self, hot_rows: tuple[int, ...] = (), **kw: Any) -> None:
        x = _x()
        y = (x[:, 0] > 0).float()[:, None]
        for r in hot_rows:
            x[r] = x[r].abs() * 60.0  # saturates the sigmoid, ~60x the usual rows (well below the 1e3 outlier bar)
            y[r] = 1.0
        super().__init__(x, y, **kw)
        first = nn.Linear(8, 16)
        self.body = nn.Sequential(first, nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.prob = nn.Sigmoid()
        with torch.no_grad():
            self.head.weight.abs_()
            first.weight.abs_()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        p = self.prob(self.head(self.body(x)).float())
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


class BatchNormNet(_Base):
    """Linear -> BatchNorm1d: one row at 1e20 overflows the batch variance, and the running statistics become inf."""

    def __init__(self, hot_row: int | None = None, **kw: Any) -> None:
        x = _x()
        if hot_row is not None:
            x[hot_row] = 1e20
        super().__init__(x, x[:, :1] * 0.5, **kw)
        self.encoder = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.relu(self.norm(self.encoder(x)))), y)
