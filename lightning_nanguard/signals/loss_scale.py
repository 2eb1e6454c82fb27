"""Readings behind ``LossScaleWatchdog`` that touch tensors: parameter finiteness and the GradScaler's schedule.

Only public GradScaler API here; the scaler's private tensors are read in ``_lightning_compat``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ScalerSchedule", "params_finite", "scaler_schedule"]


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


def params_finite(params: Iterable[Tensor]) -> Tensor:
    """0-d bool tensor: every element is finite. One ``_foreach_norm`` per (device, dtype) group, no host read.

    A 2-norm propagates NaN and inf, so one fused norm pass answers the question for all tensors at once. Norms are
    accumulated in float64 where the device has it (the incident path, not every step), so no finite weight, however
    large, reads as overflow.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for p in params:
        if p.is_floating_point() and p.numel() > 0:
            groups[(p.device, p.dtype)].append(p.detach())
    if not groups:
        return torch.tensor(True)
    device = next(iter(groups))[0]
    verdicts = []
    for tensors in groups.values():
        norms = _norms(tensors)
        verdicts.append(torch.isfinite(torch.stack(norms)).all().to(device))
    return torch.stack(verdicts).all()


def _norms(tensors: list[Tensor]) -> list[Tensor]:
    for dtype in (torch.float64, torch.float32):  # float64 is missing on some backends (MPS)
        try:
            return list(torch._foreach_norm(tensors, 2, dtype=dtype))
        except (TypeError, RuntimeError):
            continue
    return [n.float() for n in torch._foreach_norm(tensors, 2)]  # older torch without dtype=
