"""Every private or version-specific touch of Lightning/torch internals lives here, each with its public fallback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "get_scaler",
    "log_step",
    "optimizer_handles_unscaling",
    "scale_tensor",
    "should_update_logs",
]


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own ``self.log`` writes at (``_batches_that_stepped``); fallback ``global_step``."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether this training step is a logging step, exactly as Lightning's LearningRateMonitor decides it."""
    connector = getattr(trainer, "_logger_connector", None)
    try:
        return bool(connector.should_update_logs)  # type: ignore[union-attr]
    except (AttributeError, NotImplementedError):
        n = int(getattr(trainer, "log_every_n_steps", 50))
        return n > 0 and ((log_step(trainer) + 1) % n == 0 or trainer.should_stop)


def get_scaler(trainer: pl.Trainer) -> Any | None:
    """The GradScaler the precision plugin drives (16-mixed), or ``None`` (32-true, bf16, true half)."""
    return getattr(trainer.precision_plugin, "scaler", None)


def optimizer_handles_unscaling(optimizer: Optimizer) -> bool:
    """Fused optimizers unscale inside their kernel: with a GradScaler their grads are still scaled in the hook."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def scale_tensor(scaler: Any) -> Tensor | None:
    """The scaler's current scale as a device tensor, without the host read ``get_scale()`` does."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale
    if scaler is not None and scaler.is_enabled():
        return torch.tensor(float(scaler.get_scale()))
    return None
