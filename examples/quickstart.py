"""A NaN at step 30 would kill this run; GradNormMonitor drops that one update and training carries on.

Run: python examples/quickstart.py
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.testing import FaultInjector


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        x = torch.randn(512, 8)
        return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=16)


if __name__ == "__main__":
    trainer = pl.Trainer(
        max_steps=60,
        accelerator="cpu",
        log_every_n_steps=10,
        enable_checkpointing=False,
        callbacks=[FaultInjector("loss", steps=[30], value="nan"), GradNormMonitor()],
    )
    model = Regressor()
    trainer.fit(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    print("weights finite after the NaN step; see the summary above and", trainer.log_dir)
