"""The GradScaler's schedule, as ``LossScaleWatchdog`` mirrors it (parameter finiteness: ``signals.tensors``).

Only public GradScaler API here; the scaler's private tensors are read in ``_lightning_compat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ScalerSchedule", "scaler_schedule"]


@dataclass(frozen=True)
class ScalerSchedule:
    """The constants of a GradScaler's update rule (host values, no device read)."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int


def scaler_schedule(scaler: Any) -> ScalerSchedule:
    """Read the growth/backoff schedule through the public getters."""
    return ScalerSchedule(
        growth_factor=float(scaler.get_growth_factor()),
        backoff_factor=float(scaler.get_backoff_factor()),
        growth_interval=int(scaler.get_growth_interval()),
    )
