"""Tiny models that make a first non-finite value by a real mechanism at batch ``BAD_BATCH`` (no injected NaN).

Each line where the first non-finite value is made carries a marker comment ``# ORIGIN: <name>``; ``marker_line``
finds it, so a test compares the traced frame with the line of the expression itself.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

BAD_BATCH = 2
BATCH = 4
BAD_ROW = 1  # the row of the bad batch that triggers it
N = BATCH * (BAD_BATCH + 1)


def marker_line(name: str) -> int:
    """The line of this file that carries ``# ORIGIN: name``."""
    with open(__file__, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# ORIGIN: {name}"):
                return i
    raise LookupError(name)


def _x(n: int = N, dim: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


class _Dicts(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


class _Base(pl.LightningModule):
    data: Dataset[Any]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=BATCH, shuffle=False)


class NormNoEps(_Base):
    """Normalises features without eps: one all-zero record makes 0 / 0."""

    def __init__(self) -> None:
        super().__init__()
        x = _x()
        x[BAD_BATCH * BATCH + BAD_ROW] = 0.0  # an empty record
        self.data = TensorDataset(x, x[:, :1])
        self.encoder = nn.Linear(8, 16, bias=False)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.encoder(x)
        h = h / h.norm(dim=-1, keepdim=True)  # ORIGIN: norm
        return nn.functional.mse_loss(self.head(h), y)


class MaskedEntropy(_Base):
    """An entropy bonus over the allowed classes: ``torch.where(keep, p * log(p), 0)`` is finite in the forward, but
    the gradient of the masked branch is 0 * log(0) = NaN. Only the bad batch masks a class."""

    def __init__(self) -> None:
        super().__init__()
        x = _x()
        keep = torch.ones(N, 5, dtype=torch.bool)
        keep[BAD_BATCH * BATCH + BAD_ROW, 3] = False
        self.data = _Dicts(x=x, keep=keep, y=(x[:, 0] > 0).long())
        self.head = nn.Linear(8, 5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self.head(batch["x"]).masked_fill(~batch["keep"], -math.inf)
        p = torch.softmax(logits, dim=-1)
        entropy = -torch.where(batch["keep"], p * torch.log(p), 0.0).sum(-1)  # ORIGIN: where
        return nn.functional.cross_entropy(logits, batch["y"]) - 0.01 * entropy.mean()


class MaskedAttention(_Base):
    """Self-attention with an additive padding mask of -inf in the batch. With ``fully_masked``, one row of the bad
    batch masks every position: its softmax is 0 / 0. With ``nan_record``, one record of the bad batch holds a NaN
    feature (a fault unrelated to the mask)."""

    def __init__(self, fully_masked: bool = False, nan_record: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        x = torch.randn(N, 6, 8, generator=torch.Generator().manual_seed(0))
        y = x.mean(dim=(1, 2))
        mask = torch.zeros(N, 6, 6)
        mask[:, :, 4:] = -math.inf  # the last two positions are padding: intended, not bad data
        if fully_masked:
            mask[BAD_BATCH * BATCH + BAD_ROW, 2, :] = -math.inf
        if nan_record:
            x[BAD_BATCH * BATCH + BAD_ROW, 1, 3] = math.nan
        self.data = _Dicts(x=x, mask=mask, y=y)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        q, k, v = self.qkv(batch["x"]).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + batch["mask"]
        attn = torch.softmax(scores, dim=-1)  # ORIGIN: softmax
        out = self.head((attn @ v).mean(dim=1)).squeeze(-1)
        return nn.functional.mse_loss(out, batch["y"])


class SigmoidBCE(_Base):
    """A hand-written BCE on sigmoid probabilities. A confident record (logit ~10) is fine in float32, but in
    bfloat16 p rounds to 1.0 and log(1 - p) = log(0)."""

    def __init__(self) -> None:
        super().__init__()
        x = _x() * 0.1
        y = (x[:, 0] > 0).float()
        x[BAD_BATCH * BATCH + BAD_ROW] = 1.0
        y[BAD_BATCH * BATCH + BAD_ROW] = 1.0
        self.data = TensorDataset(x, y)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.head.weight.fill_(1.25)  # logit 10 on the confident record
            self.head.bias.zero_()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        p = torch.sigmoid(self.head(x)).squeeze(-1)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # ORIGIN: bce


class HandSoftmax(_Base):
    """A hand-written softmax: exp of scores past 11.1 overflows float16 (and inf / inf = NaN); fine in float32."""

    def __init__(self) -> None:
        super().__init__()
        x = _x()
        x[BAD_BATCH * BATCH + BAD_ROW] *= 20.0
        self.data = TensorDataset(x, (x[:, 0] > 0).long())
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.head.weight.mul_(4.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scores = self.head(x)
        e = torch.exp(scores)  # ORIGIN: exp
        p = e / e.sum(dim=-1, keepdim=True)
        return nn.functional.nll_loss(torch.log(p.float().clamp_min(1e-4)), y)


class PairDistance(_Base):
    """A distance ``sqrt(sum(d ** 2))`` between two views: a record whose views coincide has distance 0, and the
    gradient of sqrt at 0 is inf (the forward is finite)."""

    def __init__(self) -> None:
        super().__init__()
        a, b = _x(), _x(seed=1)
        b[BAD_BATCH * BATCH + BAD_ROW] = a[BAD_BATCH * BATCH + BAD_ROW]
        self.data = TensorDataset(a, b)
        self.proj = nn.Linear(8, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        a, b = batch
        d = self.proj(a) - self.proj(b)
        dist = torch.sqrt((d**2).sum(dim=-1))  # ORIGIN: sqrt
        return (dist - 1.0).pow(2).mean()


class NaNRecord(_Base):
    """A plain regression; one record of the bad batch holds a NaN feature."""

    def __init__(self) -> None:
        super().__init__()
        x = _x()
        x[BAD_BATCH * BATCH + BAD_ROW, 3] = math.nan
        self.data = TensorDataset(x, x[:, :1])
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.body(x)  # ORIGIN: input
        return nn.functional.mse_loss(self.head(h), y)


class ScaledSquare(nn.Module):
    """An un-normalised second-order feature: past ~256, x * x overflows float16's 65504."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale
        return h * h  # ORIGIN: square


class SquareFeatures(_Base):
    """Regression on second-order features; the bad batch is a shard at 1000x the usual scale."""

    def __init__(self) -> None:
        super().__init__()
        x = _x()
        x[BAD_BATCH * BATCH : (BAD_BATCH + 1) * BATCH] *= 1000.0
        self.data = TensorDataset(x, x[:, :1] * 0.5)
        self.encoder = nn.Linear(8, 16)
        self.square = ScaledSquare(16)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.square(self.encoder(x))).float(), y.float())


class TraceAt(pl.Callback):
    """Traces the replay of chosen batches in a real fit, where the engine would: before the optimizer step, on the
    weights the step saw; then drops that update. ``traced[batch_idx]`` is the ``TracedPass``."""

    def __init__(self, *batches: int) -> None:
        self.batches = set(batches)
        self.traced: dict[int, Any] = {}
        self.batch: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.batch = batch

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from lightning_nanguard.forensics.replay import trace_pass

        idx = trainer.fit_loop.epoch_loop.batch_idx
        if idx in self.batches:
            self.traced[idx] = trace_pass(trainer, pl_module, self.batch, idx)
            self.on_traced(trainer, pl_module, idx)
        optimizer.zero_grad(set_to_none=True)  # the weights stay those the bad batch met

    def on_traced(self, trainer: pl.Trainer, pl_module: pl.LightningModule, idx: int) -> None:
        """Called after each trace (a test subclass writes a bundle here)."""


def fit(model: pl.LightningModule, callback: pl.Callback, precision: str = "32-true", root: str = ".") -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=BAD_BATCH + 1,
        precision=precision,  # type: ignore[arg-type]
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=root,
    )
    trainer.fit(model)
    return trainer
