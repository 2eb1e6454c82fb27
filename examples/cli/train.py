"""A LightningCLI entry point for the shipped configs: a small regression on data with one bad row.

pip install -e ".[cli]"
python examples/cli/train.py fit --config examples/cli/preset.yaml
python examples/cli/train.py fit --config examples/ablation/none.yaml          # the same run, unguarded
nanguard ablate --entry examples/cli/train.py --yaml examples/ablation/*.yaml  # the whole grid, compared
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class BadRowData(pl.LightningDataModule):
    """512 samples, ``bad_rows`` of which hold a NaN feature (a broken record in the data, seen every epoch)."""

    def __init__(self, bad_rows: int = 1, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(512, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        x[torch.randperm(512, generator=g)[:bad_rows], 3] = float("nan")
        self.train_set = TensorDataset(x, y)
        xv = torch.randn(128, 8, generator=g)
        self.val_set = TensorDataset(xv, xv[:, :1] * 0.5 - xv[:, 1:2] * 0.25)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


def main() -> None:
    LightningCLI(
        Regressor,
        BadRowData,
        trainer_defaults={"max_epochs": 4, "accelerator": "cpu", "enable_checkpointing": False},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
