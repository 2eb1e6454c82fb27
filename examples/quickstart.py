"""One broken record in the data kills this run at its first epoch; with the suite it trains to the end.

Run: python examples/quickstart.py
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import default_callbacks


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
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=g)
        y = x[:, :1] - x[:, 1:2]
        x[137, 2] = float("nan")  # one broken record, seen once per epoch
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


if __name__ == "__main__":
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", enable_checkpointing=False, callbacks=default_callbacks())
    model = Regressor()
    trainer.fit(model)  # without callbacks=..., every weight is NaN after the first epoch
    assert all(torch.isfinite(p).all() for p in model.parameters())
    print("trained to the end with finite weights; the bad sample was quarantined. Incidents:", trainer.log_dir)
