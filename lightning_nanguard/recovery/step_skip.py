"""Drop one optimizer update before it lands, without fighting the GradScaler."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

__all__ = ["drop_update"]


def drop_update(optimizer: Optimizer, *, scaler_active: bool, fused_with_scaler: bool, grads_finite: bool) -> str:
    """Make the coming ``optimizer.step()`` a no-op for the parameters and the optimizer state.

    * With a GradScaler and non-finite grads, the scaler already skips the step: do nothing (``"scaler"``).
    * Fused optimizer under a GradScaler with finite grads: ``set_to_none`` would crash the scaler's fused path
      ("No inf checks were recorded"), so one gradient element is set to inf; the scaler then skips the update and
      backs off its scale once (``"scaler_inf"``).
    * Otherwise: ``zero_grad(set_to_none=True)``. Adam's step count and moments stay untouched; zeroing in place
      would still let momentum and weight decay move the weights (``"set_to_none"``).
    """
    if scaler_active and not grads_finite:
        return "scaler"
    if fused_with_scaler:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.view(-1)[:1].fill_(torch.inf)
                    return "scaler_inf"
        return "scaler_inf"
    optimizer.zero_grad(set_to_none=True)
    return "set_to_none"
