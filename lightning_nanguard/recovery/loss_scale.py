"""Lower the GradScaler's scale ahead of an overflow: on the device, with the scaler's public ``update(new_scale)``."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_nanguard import _lightning_compat

__all__ = ["lower_scale_to"]


def lower_scale_to(trainer: pl.Trainer, at_most: float) -> bool:
    """Set the enabled GradScaler's scale to ``min(scale, at_most)``: never raised, no host read (the minimum is
    taken on the device). Called between two optimizer steps (a batch start with no gradient accumulation pending):
    ``update(new_scale)`` then only fills the scale and drops the per-optimizer state the next step builds afresh,
    and leaves the growth tracker alone. Before the scaler's first step, the initial scale it starts from is lowered
    instead. False where there is no enabled GradScaler."""
    scaler = _lightning_compat.active_scaler(trainer)
    if scaler is not None and not _lightning_compat.scale_started(scaler):  # before the first step: where it starts
        _lightning_compat.clamp_scale(scaler, 0.0, at_most)
        return True
    scale = _lightning_compat.scale_tensor(scaler) if scaler is not None else None
    if scaler is None or scale is None:
        return False
    scaler.update(new_scale=scale.clamp(max=at_most))
    return True
