"""What one optimizer's step reading needs that does not change from step to step, built on its first step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_nanguard import _lightning_compat
from lightning_nanguard.engine.reading import DropPath
from lightning_nanguard.signals.gradients import ParamIndex, inline_applies

__all__ = ["StepPlan", "drop_path"]


def drop_path(trainer: pl.Trainer, optimizer: Optimizer) -> DropPath:
    """How this optimizer drops an update: through the GradScaler, its own fused ``found_inf``, or on the host."""
    scaler = _lightning_compat.get_scaler(trainer)
    if scaler is not None and scaler.is_enabled():
        return DropPath.SCALER
    if _lightning_compat.accepts_found_inf(optimizer):
        return DropPath.FUSED
    return DropPath.HOST


class StepPlan:
    """One optimizer's plan: its parameter index, drop path, device and world.

    ``quick``: ``Sensor.quick`` reads this optimizer's steps (the host path on one process, a few plain float32 or
    float64 gradients of one device, no loss scale)."""

    __slots__ = (
        "count",
        "device",
        "group_params",
        "handles_unscaling",
        "index",
        "inline",
        "opt_idx",
        "optimizer",
        "params",
        "path",
        "quick",
        "world",
    )

    def __init__(
        self,
        trainer: pl.Trainer,
        optimizer: Optimizer,
        opt_idx: int,
        index: ParamIndex,
        path: DropPath,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.opt_idx = opt_idx
        self.index = index
        self.path = path
        self.device = device
        self.world = trainer.world_size
        self.handles_unscaling = _lightning_compat.optimizer_handles_unscaling(optimizer)
        self.inline = inline_applies(index)
        self.params = index.params
        self.count = index.count
        groups = optimizer.param_groups
        self.group_params = groups[0]["params"] if len(groups) == 1 else None  # ``same_params``'s shortcut
        self.quick = (
            self.inline
            and path is DropPath.HOST
            and self.world == 1
            and index.params[0].dtype in (torch.float32, torch.float64)
        )

    def current(self, optimizer: Optimizer) -> bool:
        """Still valid: the same optimizer object, holding the same parameters (``ParamIndex.matches``)."""
        return self.optimizer is optimizer and self.index.matches(optimizer)

    def same_params(self, optimizer: Optimizer) -> bool:
        """``current``, with a shortcut for one param group: still the same list of parameters, of the same length."""
        groups = optimizer.param_groups
        if len(groups) == 1 and self.optimizer is optimizer:
            params = groups[0]["params"]
            if params is self.group_params and len(self.group_params) == self.index.count:
                return True
        return self.current(optimizer)
