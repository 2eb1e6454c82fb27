"""The matrix's model kinds: the tiny Linear-BatchNorm-Tanh-Linear model as it is (``mlp``), and as the models people
really train change it. Each kind keeps the BatchNorm (the ``buffer`` site) and a dense first parameter (the
``param`` and ``grad`` sites' ``FaultInjector`` target), so every fault applies to every kind.

* ``iterable``: the same data from an ``IterableDataset`` (no sampler indices: a bad batch is quarantined by its
  fingerprint);
* ``sparse``: a sparse (COO) feature-mixing matrix registered as a buffer, a graph's adjacency (``torch.sparse.mm``,
  in float32 as sparse kernels need), and a per-row embedding with ``sparse=True`` (sparse gradients); Adagrad, which
  takes sparse gradients (AdamW does not; SGD's momentum for them has no float16 kernel on the CPU);
* ``lazy``: the first layer an ``nn.LazyLinear``, materialized by the first forward (after the step-0 snapshot);
* ``growing``: a non-persistent cos cache that grows from 4 to 8 entries at step 6, as a rotary cache does when a
  longer sequence arrives (registered again; a rollback across the growth restores it at its snapshot's size);
* ``inf-buffer``: a persistent attention-style mask buffer holding ``-inf`` (intended: a softmax over it gives 0);
* ``ema`` / ``swa``: the plain model with Lightning's ``EMAWeightAveraging`` / ``StochasticWeightAveraging`` listed
  after the suite (their ``on_train_end`` copies their average into the model, after the first end-of-fit check).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

__all__ = ["GROW_AT", "KINDS", "MatrixModel", "averaging_callbacks"]

KINDS = ("mlp", "iterable", "sparse", "lazy", "growing", "inf-buffer", "ema", "swa")
GROW_AT = 6  # the ``growing`` kind's cache grows at this optimizer step


class _Stream(IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from zip(self.x, self.y, strict=True)


class MatrixModel(pl.LightningModule):
    """Linear -> BatchNorm1d -> Tanh -> Linear regression, changed by ``kind`` (module docstring); ``manual-2opt``:
    manual optimization, body and head each with its own optimizer (AdamW, SGD; Adagrad for the sparse body)."""

    def __init__(self, optimization: str = "automatic", kind: str = "mlp", n: int = 80, batch_size: int = 8) -> None:
        super().__init__()
        self.kind = kind
        first: nn.Module = nn.LazyLinear(16) if kind == "lazy" else nn.Linear(8, 16)
        self.body = nn.Sequential(first, nn.BatchNorm1d(16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        if kind == "sparse":
            g = torch.Generator().manual_seed(3)
            idx = torch.stack([torch.arange(16), torch.randint(0, 16, (16,), generator=g)])
            mix = torch.sparse_coo_tensor(idx, torch.full((16,), 0.5), (16, 16), check_invariants=True)
            self.register_buffer("mix", mix.coalesce())
            # Every rank builds the same matrix; DDP cannot broadcast a sparse tensor ("No support for sparse
            # tensors"), so it is told to leave it, as a GCN trained under DDP does.
            self._ddp_params_and_buffers_to_ignore = ["mix"]
            self.row_bias = nn.Embedding(batch_size, 16, sparse=True)
            nn.init.zeros_(self.row_bias.weight)
        if kind == "growing":
            self._cache(4)
        if kind == "inf-buffer":
            self.register_buffer("mask", torch.tensor([0.0] * 8 + [-math.inf] * 8))
        self.optimization, self.n, self.batch_size = optimization, n, batch_size
        self.automatic_optimization = optimization != "manual-2opt"

    def _cache(self, n: int) -> None:
        self.register_buffer("cos_cached", torch.cos(torch.arange(n, dtype=torch.float32) / n), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.kind == "sparse":
            with torch.autocast(x.device.type, enabled=False):
                mixed = torch.sparse.mm(self.mix.float(), h.float().t()).t()
            rows = torch.arange(h.shape[0], device=h.device) % self.batch_size
            h = h + mixed.to(h.dtype) + self.row_bias(rows)
        elif self.kind == "growing":
            size = 8 if self.global_step >= GROW_AT else 4
            if size > self.cos_cached.numel():
                self._cache(size)
            h = h * self.cos_cached[:size].mean().to(h.dtype)
        elif self.kind == "inf-buffer":
            h = h * (1 + torch.softmax(self.mask.float(), 0)[:16].sum().to(h.dtype))
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y.float())
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        assert isinstance(opts, list)
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss.detach()

    def _body_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.kind == "sparse":
            return torch.optim.Adagrad(params, lr=0.05)
        return torch.optim.AdamW(params, lr=0.01)

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            return self._body_optimizer(self.parameters())
        head = set(map(id, self.head.parameters()))
        return [
            self._body_optimizer([p for p in self.parameters() if id(p) not in head]),
            torch.optim.SGD(self.head.parameters(), lr=0.01, momentum=0.9),
        ]

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        if self.kind == "iterable":
            return DataLoader(_Stream(x, y), batch_size=self.batch_size)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def _ema(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor, decay: float) -> torch.Tensor:
    return decay * averaged + (1 - decay) * current  # torch's get_ema_avg_fn, at module level


class _EMA(EMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` with its averaging function at module level: ``ddp_spawn`` pickles the
    callbacks, and Lightning's is a closure (plain Lightning fails the same way under ``ddp_spawn``)."""

    def __init__(self, decay: float) -> None:
        super().__init__(decay=decay)
        self._kwargs["avg_fn"] = functools.partial(_ema, decay=decay)


def averaging_callbacks(kind: str) -> list[pl.Callback]:
    """The weight-averaging callback of the ``ema`` and ``swa`` kinds (listed after the suite), else none."""
    if kind == "ema":
        return [_EMA(decay=0.9)]
    if kind == "swa":
        return [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]
    return []
