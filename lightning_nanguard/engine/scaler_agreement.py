"""DDP with a GradScaler and no member that senses the steps: the ranks' scalers still skip together."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["agree_scaler_skip"]


def agree_scaler_skip(trainer: pl.Trainer, optimizer: Optimizer) -> None:
    """Under DDP with a GradScaler: make every rank's scaler skip (and back off) when any rank's found an inf.

    DDP's gradients are identical on every rank after the all-reduce, but a fault after it (or a rank-local
    overflow in ``unscale_``) makes one scaler skip and halve its scale while the others step: the ranks' weights and
    scales split for good. One SUM all-reduce of the local verdict, on the device (no host read); used when no
    nanguard member senses the steps (the sensor's reduced verdict does the same otherwise).
    """
    scaler = _lightning_compat.get_scaler(trainer)
    found = _lightning_compat.found_inf_per_device(scaler, optimizer)
    if found:
        local = torch.stack([t.reshape(()).float() for t in found.values()]).amax()
    else:  # a fused optimizer unscales inside its step: read its (still scaled) gradients
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        local = (~all_finite(grads)).float()
    reduced = _distributed.sum_across_ranks(trainer, local.reshape(1))[0] > 0
    _lightning_compat.or_into_found_inf(scaler, optimizer, reduced)
