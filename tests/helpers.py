"""Tiny models and Trainer factories shared by the tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed"]


class TinyModel(pl.LightningModule):
    """A two-layer MLP regression: deterministic, well under a second per fit on CPU."""

    def __init__(self, lr: float = 0.05, n: int = 64, batch_size: int = 8, optimizer: str = "adamw", **opt_kw: Any):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.lr, self.n, self.batch_size, self.optimizer_name, self.opt_kw = lr, n, batch_size, optimizer, opt_kw
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, **self.opt_kw)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, **self.opt_kw)

    def _data(self, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.n, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._data(0)

    def val_dataloader(self) -> DataLoader:
        return self._data(1)


def precision_kwargs(precision: str) -> dict[str, Any]:
    """Trainer kwargs for a precision; '16-mixed' uses a real fp16 autocast + GradScaler on CPU."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


def make_trainer(tmp_path: Any, precision: str = "32-true", logger: Any = False, **kw: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": str(tmp_path),
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "logger": logger,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "deterministic": True,
    }
    defaults.update(precision_kwargs(precision))
    defaults.update(kw)
    return pl.Trainer(**defaults)


def loggers(tmp_path: Any) -> list[Any]:
    return [TensorBoardLogger(str(tmp_path), name="tb", version=0), CSVLogger(str(tmp_path), name="csv", version=0)]


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def all_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def tb_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard run directory, read with tensorboard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tb_tags(log_dir: str) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    return acc.Tags()


def csv_metrics(log_dir: str) -> list[dict[str, str]]:
    import csv
    import os

    with open(os.path.join(log_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


class HostReadsPerStep(pl.Callback):
    """Counts host reads (``HostReadCounter``) from batch start to batch end, optimizer step included."""

    def __init__(self) -> None:
        self.per_step: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        from lightning_nanguard.testing import HostReadCounter

        self._reads = HostReadCounter().__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self._reads.__exit__(None, None, None)
        self.per_step.append(self._reads.count)
