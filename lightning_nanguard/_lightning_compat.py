"""Every private or version-specific touch of Lightning/torch internals lives here, each with its public fallback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "batch_counter",
    "clamp_scale",
    "get_scaler",
    "log_step",
    "optimizer_handles_unscaling",
    "scale_tensor",
    "scaler_state",
    "should_update_logs",
    "strategy_class_names",
]


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own ``self.log`` writes at (``_batches_that_stepped``); fallback ``global_step``."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def batch_counter(trainer: pl.Trainer) -> int:
    """Training batches started so far in this fit (identifies the current batch, micro-batches included)."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    progress = getattr(getattr(loop, "batch_progress", None), "total", None)
    return int(getattr(progress, "ready", -1))


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


def scaler_state(scaler: Any) -> tuple[float, int]:
    """The scaler's current scale and growth tracker in one host read; the initial values before its lazy init."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor):
        both = torch.stack([scale.detach().reshape(()).double(), tracker.detach().reshape(()).double()])
        value, count = both.tolist()
        return float(value), int(count)
    # Public fallback: get_scale() returns the initial scale while ``_scale`` is still None (first step not taken).
    get_tracker = getattr(scaler, "_get_growth_tracker", None)
    return float(scaler.get_scale()), int(get_tracker()) if callable(get_tracker) else 0


def clamp_scale(scaler: Any, low: float, high: float | None) -> None:
    """Keep the scaler's scale in ``[low, high]``: in place on the device, no host read.

    Before the scaler's lazy init (``_scale is None``) the initial scale it will start from is clamped instead.
    """
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        scale.clamp_(min=low, max=high)
        return
    init = getattr(scaler, "_init_scale", None)
    if isinstance(init, (int, float)):
        scaler._init_scale = min(max(float(init), low), high if high is not None else float("inf"))
        return
    current = float(scaler.get_scale())  # public fallback: one host read, then update(new_scale)
    clamped = min(max(current, low), high if high is not None else float("inf"))
    if clamped != current:
        scaler.update(clamped)


def strategy_class_names(trainer: pl.Trainer) -> set[str]:
    """Names of the strategy's classes (its MRO), to recognize strategies whose packages may not be installed."""
    return {cls.__name__ for cls in type(trainer.strategy).__mro__}
