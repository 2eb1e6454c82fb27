"""Building blocks shared by the demo tasks: a regression LightningModule, a tensor DataModule, precision settings."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DemoModule", "TensorDataModule", "precision_kwargs", "probe_loss"]


def precision_kwargs(precision: str) -> dict[str, Any]:
    """Trainer kwargs for ``precision``. ``"16-mixed"`` gets a real float16 autocast and GradScaler on any device.

    Plain ``Trainer(precision="16-mixed")`` on CPU silently becomes bfloat16 (no GradScaler), which would hide every
    fp16 mechanism; a fresh scaler is built for each call, so runs never share one.
    """
    if precision == "16-mixed":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return {"plugins": [MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device))]}
    return {"precision": precision}


class DemoModule(pl.LightningModule):
    """Mean-squared-error regression around any ``net``; logs ``train_loss`` (epoch mean) and ``val_loss``.

    Args:
        net: the model; called on the batch's inputs.
        lr: the learning rate.
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum 0.9).
        opt_kw: extra optimizer keyword arguments (``eps``, ``weight_decay``, ...).
        lr_lambda: an optional ``LambdaLR`` multiplier per optimizer step (warmup schedules).
    """

    def __init__(
        self,
        net: nn.Module,
        *,
        lr: float,
        optimizer: str = "adamw",
        opt_kw: dict[str, Any] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.lr, self.optimizer_name, self.opt_kw, self.lr_lambda = lr, optimizer, dict(opt_kw or {}), lr_lambda

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y.float())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch[0]))
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, batch_size=len(batch[0]))
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(), lr=self.lr, **{"momentum": 0.9, **self.opt_kw}
            )
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, **self.opt_kw)
        if self.lr_lambda is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TensorDataModule(pl.LightningDataModule):
    """Fixed tensors as train/val loaders (map-style, so nanguard's quarantine sees sample indices).

    ``probe`` is the training data with the fault removed: the runner measures the final training loss on it (in
    float32, eval mode), so a bad row or shard cannot make a healthy model look broken, nor hide a broken one.
    """

    def __init__(
        self,
        train: tuple[Tensor, Tensor],
        val: tuple[Tensor, Tensor],
        *,
        batch_size: int,
        probe: tuple[Tensor, Tensor] | None = None,
        val_batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.train_set, self.val_set = TensorDataset(*train), TensorDataset(*val)
        self.probe_set = TensorDataset(*(probe if probe is not None else train))
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.shuffle, self.seed = shuffle, seed

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, generator=g)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=self.val_batch_size)

    def probe_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.probe_set, batch_size=256)


@torch.no_grad()
def probe_loss(module: DemoModule, loader: DataLoader[Any]) -> float:
    """Mean MSE of a float32 eval-mode copy of ``module`` over ``loader`` (NaN if anything is non-finite)."""
    net = copy.deepcopy(module.net).float().eval().cpu()
    total, count = 0.0, 0
    for x, y in loader:
        err = nn.functional.mse_loss(net(x.float()), y.float(), reduction="sum")
        total += float(err)
        count += int(y.numel())
    return total / count if count and math.isfinite(total) else math.nan
