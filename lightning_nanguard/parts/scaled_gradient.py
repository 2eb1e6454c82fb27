"""PrecisionHeadroom's loss-scaled gradient (``16-mixed``): sampled with the module outputs, and the GradScaler's
scale lowered ahead of a float16 overflow in the backward.

Under autocast a weight's gradient is computed in float16 at the loss scale: the GradScaler only learns that it
overflowed after the fact (a dropped step, then it halves). On a sampled step (``HeadroomWatch``'s clock) the largest
parameter gradient times the scale it ran with, and that scale, become two more entries of the sampled vector (taken
in ``on_before_optimizer_step`` on the device: the scale's own tensor, no host read), all-reduced and mirrored with
it. At its read, a headroom under ``scale_margin_bits`` has the scale lowered by a power of two before the step
(``policies.headroom.scale_cut``, ``recovery.loss_scale``): identically on every rank (the vector was MAX-reduced),
never below LossScaleWatchdog's ``min_scale`` (1.0 without it), never raised (the GradScaler's growth does that). A
power of two changes no float16 value that neither overflows nor underflows: on a healthy run nothing else moves.

The cut is made only where a batch start is a step boundary: automatic optimization without gradient accumulation
(elsewhere a cut between two backward passes of one update would mix two scales in its gradient); under manual
optimization the headroom is reported only. (Under gradient accumulation a sample ends with its step's first
micro-batch, before the optimizer step: the gradient is not sampled.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_nanguard import _lightning_compat
from lightning_nanguard.policies.headroom import ScaleLowerings, scale_cut
from lightning_nanguard.precision import Precision
from lightning_nanguard.recovery.loss_scale import lower_scale_to
from lightning_nanguard.reporting import keys
from lightning_nanguard.signals.headroom import dtype_max, headroom_bits, scaled_grad_amax

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_nanguard.engine.engine import Engine

__all__ = ["ENTRIES", "ScaledGradient"]

ENTRIES = 2  # [largest gradient x scale, scale] at the end of the sampled vector
NO_WATCHDOG_FLOOR = 1.0  # LossScaleWatchdog's default min_scale: the floor where it is not installed


class ScaledGradient:
    """The loss-scaled gradient of one callback's samples: collected, read, and the scale cut it calls for."""

    def __init__(self, margin_bits: float | None) -> None:
        self.margin_bits = margin_bits
        self.active = False  # 16-mixed with an enabled GradScaler
        self.can_cut = False  # ... and the batch start is a step boundary
        self.bits: float | None = None  # the headroom at the last sample (at the scale that step ran with)
        self.lowerings = ScaleLowerings()
        self._vec: Tensor | None = None

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, precision: Precision, idle: bool) -> None:
        self.active = (
            not idle
            and precision.mixed
            and precision.dtype is torch.float16
            and _lightning_compat.active_scaler(trainer) is not None
        )
        self.can_cut = self.active and pl_module.automatic_optimization and trainer.accumulate_grad_batches == 1
        self._vec = None

    def collect(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        """``on_before_optimizer_step`` of a sampled step: ``optimizer``'s largest gradient times the scale, and the
        scale (taken now, before the scaler's update changes its tensor in place); the largest over the step's
        optimizers."""
        if not self.active:
            return
        scale = _lightning_compat.scale_tensor(_lightning_compat.active_scaler(trainer))
        if scale is None:
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # A fused optimizer unscales inside its step: its gradients are still at the loss scale here.
        unscaled = not _lightning_compat.optimizer_handles_unscaling(optimizer)
        amax = scaled_grad_amax(grads, scale if unscaled else None)
        if amax is None:
            return
        pair = torch.stack([amax.float(), scale.to(device=amax.device, dtype=torch.float32).reshape(())])
        self._vec = pair if self._vec is None else torch.maximum(self._vec, pair)

    def take(self) -> Tensor | None:
        """The sampled step's two entries (``None``: none were collected); cleared."""
        vec, self._vec = self._vec, None
        return vec

    def read(self, trainer: pl.Trainer, engine: Engine, amax: float, ran_with: float, *, act: bool) -> None:
        """The sample's two host values: the headroom kept; the scale cut to ``ran_with / 2**k`` at most where it is
        under the margin (``act``: not at the end of training)."""
        limit = dtype_max(torch.float16)
        bits = headroom_bits(amax, limit)
        self.bits = bits if math.isfinite(bits) else None
        if not (act and self.can_cut):
            return
        watch = engine.registry.scale_watch
        floor = watch.min_scale if watch is not None else NO_WATCHDOG_FLOOR
        halvings = scale_cut(amax, ran_with, limit=limit, margin_bits=self.margin_bits, floor=floor)
        if halvings and lower_scale_to(trainer, ran_with / 2.0**halvings):
            self.lowerings.add(bits, halvings, ran_with)

    def metrics(self) -> dict[str, float]:
        if not self.active:
            return {}
        out = {keys.LOSS_SCALE_LOWERED: float(self.lowerings.count)}
        if self.bits is not None:
            out[keys.HEADROOM_SCALED_GRAD] = self.bits
        return out

    def summary_lines(self) -> list[str]:
        line = self.lowerings.summary(self.margin_bits or 0.0)
        return [line] if line else []

    def state_dict(self) -> dict[str, object]:
        return self.lowerings.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lowerings.load_state_dict(state)
