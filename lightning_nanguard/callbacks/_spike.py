"""Loss and gradient-norm spike detection for GradNormMonitor: a registered on-device detector, no host read."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_nanguard import _lightning_compat
from lightning_nanguard.signals.gradients import GradReading
from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["SpikeWatch"]


class SpikeWatch:
    """Running z-scores of log(grad norm) and log(|loss|); a step spikes when either exceeds ``threshold``.

    The test runs inside the shared step health as a registered detector, so its verdict rides on the step's one
    cross-rank reduction and one host read. The loss is unscaled first under a GradScaler (the loss Lightning hands to
    ``on_before_backward`` is multiplied by the current scale).
    """

    def __init__(self, threshold: float, warmup: int) -> None:
        self.threshold = threshold
        self.grad = RunningZScore(threshold, warmup)
        self.loss = RunningZScore(threshold, warmup)
        self._trainer: pl.Trainer | None = None

    def attach(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    def detect(self, grads: GradReading | None, loss: Tensor | None) -> Tensor:
        flags = []
        if grads is not None:
            flags.append(self.grad.observe(grads.total_norm))
        if loss is not None:
            scaler = _lightning_compat.get_scaler(self._trainer) if self._trainer is not None else None
            scale = _lightning_compat.scale_tensor(scaler) if scaler is not None and scaler.is_enabled() else None
            value = loss.abs() if scale is None else loss.abs() / scale.to(loss.device)
            flags.append(self.loss.observe(value))
        if not flags:
            return torch.zeros((), dtype=torch.bool)
        out = flags[0]
        for f in flags[1:]:
            out = out | f.to(out.device)
        return out

    def describe(self) -> tuple[str, dict[str, Any]]:
        """Which signal spiked and the z-scores (host reads: incident path only)."""
        z_grad, z_loss = float(self.grad.last_z), float(self.loss.last_z)
        grad_spiked, loss_spiked = z_grad > self.threshold, z_loss > self.threshold
        if grad_spiked and loss_spiked:
            trigger = "loss_and_grad_norm_spike"
        elif loss_spiked:
            trigger = "loss_spike"
        elif grad_spiked:
            trigger = "grad_norm_spike"
        else:
            trigger = "spike_on_other_rank"
        return trigger, {"grad_norm_zscore": z_grad, "loss_zscore": z_loss, "zscore_threshold": self.threshold}

    def state(self) -> dict[str, dict[str, float]]:
        return {"grad": self.grad.state(), "loss": self.loss.state()}

    def load(self, state: dict[str, Any]) -> None:
        self.grad.load(state.get("grad", {}))
        self.loss.load(state.get("loss", {}))
