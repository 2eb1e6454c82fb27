"""Drop one optimizer update before it lands, without fighting the GradScaler or a fused kernel."""

from __future__ import annotations

from enum import Enum

import torch
from torch.optim import Optimizer

from lightning_nanguard import _lightning_compat

__all__ = ["DropMethod", "drop_update"]


class DropMethod(str, Enum):
    """How an update was dropped."""

    SET_TO_NONE = "set_to_none"  # zero_grad(set_to_none=True): params, moments and step counts untouched
    SCALER_INF = "scaler_inf"  # fused optimizer under a GradScaler: one inf gradient element, the scaler skips
    FOUND_INF = "found_inf"  # fused optimizer: its found_inf flag, the kernel skips


def drop_update(optimizer: Optimizer, path: str) -> DropMethod:
    """Make the coming ``optimizer.step()`` a no-op for the parameters and the optimizer state.

    Args:
        optimizer: the raw torch optimizer of this step.
        path: the sensor's path for it: ``"host"`` (plain optimizer), ``"scaler"`` (a GradScaler is active) or
            ``"fused"`` (a fused optimizer that takes ``found_inf``).

    * ``zero_grad(set_to_none=True)`` (plain optimizers, and non-fused ones under a GradScaler whose inf check ran
      already): Adam's step count and moments stay untouched; zeroing in place would still let momentum and weight
      decay move the weights.
    * A fused optimizer under a GradScaler has not been inf-checked yet and ``set_to_none`` would crash the scaler
      ("No inf checks were recorded"): one gradient element becomes inf, the scaler skips and backs off once.
    * A fused optimizer alone: its ``found_inf`` flag is set to 1.
    """
    if path == "fused":
        _lightning_compat.set_found_inf(optimizer, torch.ones((), dtype=torch.bool, device=_device(optimizer)))
        return DropMethod.FOUND_INF
    if path == "scaler" and _lightning_compat.optimizer_handles_unscaling(optimizer):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _lightning_compat.first_element(p.grad).fill_(torch.inf)
                    return DropMethod.SCALER_INF
        return DropMethod.SCALER_INF
    optimizer.zero_grad(set_to_none=True)
    return DropMethod.SET_TO_NONE


def _device(optimizer: Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
