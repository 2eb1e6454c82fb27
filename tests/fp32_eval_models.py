"""A tiny model with VMamba's failure: training forces float32 for a sensitive computation, evaluation does not.

The sensitive part is a catastrophic cancellation, ``-log((1 + s * f) - 1)`` with ``f`` in (0.5, 1): for ``s = 1e-4``
the sum rounds to exactly 1 in float16 (spacing 2**-10 at 1) and in bfloat16 (2**-7), so the log is ``-inf`` and the
loss ``inf``; in float32 it is about 9.5. ``s = 0.5`` is harmless in every dtype. Validation samples carry their own
``s``, so a test chooses exactly which batches are non-finite in half precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

BAD_SCALE = 1e-4
GOOD_SCALE = 0.5


class HalfOverflowModel(pl.LightningModule):
    """Regression with a cancellation-prone penalty. Records the dtype and loss of every evaluation step call."""

    def __init__(
        self,
        bad_batches: Sequence[int] = (0, 1, 2, 3),
        n_val: int = 32,
        batch_size: int = 8,
        bad_samples: Sequence[int] | None = None,
        sync_dist: bool = False,
    ) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.bad_batches = tuple(bad_batches)
        self.bad_samples = None if bad_samples is None else tuple(bad_samples)  # overrides bad_batches (DDP tests)
        self.sync_dist = sync_dist
        self.n_val, self.batch_size = n_val, batch_size
        self.eval_calls: list[tuple[int, torch.dtype, float]] = []  # (batch_idx, output dtype, loss)
        self.train_losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.body(x)))

    @staticmethod
    def penalty(out: Tensor, scale: Tensor) -> Tensor:
        feat = 0.75 + 0.25 * out.clamp(-1, 1)
        diff = (1 + scale.to(feat.dtype) * feat) - 1  # exactly 0 in float16/bfloat16 for scale=1e-4
        return -torch.log(diff)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, scale = batch
        out = self(x)
        with torch.autocast(x.device.type, enabled=False):  # the model's own fix, applied to training only
            pen = self.penalty(out.float(), scale.float())
            loss = nn.functional.mse_loss(out.float(), y.float()) + 0.01 * pen.mean()
        self.train_losses.append(float(loss.detach()))
        return loss

    def _eval_step(self, batch: Any, batch_idx: int, name: str) -> Tensor:
        x, y, scale = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y.to(out.dtype)) + 0.01 * self.penalty(out, scale).mean()
        self.eval_calls.append((batch_idx, out.dtype, float(loss.detach())))
        self.log(name, loss, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, batch_idx, "val_loss")

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._eval_step(batch, batch_idx, "test_loss")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return self._data(0, 64, bad=range(8))

    def val_dataloader(self) -> DataLoader:
        if self.bad_samples is not None:
            return self._data(1, self.n_val, bad=(), bad_samples=self.bad_samples)
        return self._data(1, self.n_val, bad=self.bad_batches)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def _data(self, seed: int, n: int, bad: Any, bad_samples: Sequence[int] = ()) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        scale = torch.full((n, 1), GOOD_SCALE)
        for b in bad:
            scale[b * self.batch_size : (b + 1) * self.batch_size] = BAD_SCALE
        for i in bad_samples:
            scale[i] = BAD_SCALE
        return DataLoader(TensorDataset(x, y, scale), batch_size=self.batch_size, shuffle=False)

    def last_eval_losses(self) -> dict[int, float]:
        """The loss of each batch's last evaluation call (the one whose result Lightning kept)."""
        return {i: loss for i, _, loss in self.eval_calls}
