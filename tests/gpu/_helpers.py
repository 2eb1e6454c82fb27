"""What the CUDA tests share: the device, a Trainer factory, models with a real bad record, a probe of the incidents.

The tests run on a CUDA GPU (``-m gpu``) and are skipped without one. ``NANGUARD_GPU_TESTS_ON=cpu`` runs the ones
that need no CUDA feature on the CPU instead: a check of their logic on a machine without a GPU, not a substitute.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard.engine import get_engine
from tests.helpers import TinyModel, precision_kwargs

ON = os.environ.get("NANGUARD_GPU_TESTS_ON", "cuda")
ACCELERATOR = "cpu" if ON == "cpu" else "cuda"
RUNNABLE = ON == "cpu" or torch.cuda.is_available()

gpu = [pytest.mark.gpu, pytest.mark.skipif(not RUNNABLE, reason="needs a CUDA device")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA itself (streams, pinned memory)")

BAD_ROW = 20  # in batch 2 of each epoch (batch size 8)


def gpu_trainer(tmp_path: Any, precision: str = "32-true", **kw: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "default_root_dir": str(tmp_path),
        "accelerator": ACCELERATOR,
        "devices": 1,
        "precision": precision,
        "max_steps": 12,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
    }
    if ACCELERATOR == "cpu" and precision == "16-mixed":  # the CPU stand-in for the CUDA GradScaler
        del defaults["precision"]
        defaults.update(precision_kwargs("16-mixed"))
    defaults.update(kw)
    return pl.Trainer(**defaults)


class BadRecordModel(TinyModel):
    """TinyModel whose training data holds one NaN feature (a corrupt record), met once per epoch."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        x[BAD_ROW, 3] = math.nan
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


class Incidents(pl.Callback):
    """Keeps the run's incidents (step, actions, cause) and whether the final parameters are finite."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str], str]] = []
        self.finite = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = [(r.step, list(r.actions), r.cause) for r in get_engine(trainer).sink.records]
        self.finite = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters())


def training_state(pl_module: pl.LightningModule, trainer: pl.Trainer) -> list[torch.Tensor]:
    """Clones of the parameters and every optimizer-state tensor, in a fixed order."""
    tensors = [t.detach().clone() for t in pl_module.parameters()]
    for opt in trainer.optimizers:
        for state in opt.state.values():
            tensors.extend(v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


class StateProbe(pl.Callback):
    """The training state at the start of batch ``taken`` (where AutoRollback snapshots it; place this callback after
    AutoRollback), and whether the state at the end of batch ``restored`` equals it bit for bit."""

    def __init__(self, taken: int, restored: int) -> None:
        self.taken, self.restored = taken, restored
        self.snapshot: list[torch.Tensor] = []
        self.exact: bool | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == self.taken:
            self.snapshot = training_state(pl_module, trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if i == self.restored:
            now = training_state(pl_module, trainer)
            self.exact = len(now) == len(self.snapshot) and all(
                torch.equal(a, b) for a, b in zip(now, self.snapshot, strict=True)
            )
