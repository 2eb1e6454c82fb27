"""GradNormMonitor's logged values on a logging step: the interval's, the clipped norm, the per-layer norms.

Host floats the engine already has, plus, only where due, the per-layer norms (one ``index_add_`` and one host read
of the last step's per-tensor norms), the histogram of the finite per-tensor norms and, under value clipping, the
clipped norm (one fused pass).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch

from lightning_nanguard import _lightning_compat
from lightning_nanguard.engine.accounting import Interval
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.engine.sharded_sensing import current_grad_norm
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.reporting import emit, keys
from lightning_nanguard.signals.gradients import layer_norms

__all__ = ["clipped_norm", "grad_metrics", "layers_due"]


def grad_metrics(
    trainer: pl.Trainer,
    interval: Interval,
    reading: Reading | None,
    *,
    skipped: int,
    quarantine: Quarantine | None,
    layers: bool,
    histogram: bool,
) -> dict[str, float]:
    """The values of ``GradNormMonitor``'s logged keys (its docstring has the table)."""
    out: dict[str, float] = {
        keys.SKIPPED_STEPS: float(skipped),
        keys.NONFINITE_STEPS: float(interval.nonfinite_steps),
    }
    if not math.isnan(interval.grad_norm):
        out[keys.GRAD_NORM] = interval.grad_norm  # the last finite step's norm
    if interval.grad_norm_max > -math.inf:
        out[keys.GRAD_NORM_MAX] = interval.grad_norm_max  # inf when a step of the interval was non-finite
    if not math.isnan(interval.loss):
        out[keys.LOSS] = interval.loss
    if quarantine is not None:
        out[keys.QUARANTINED] = float(len(quarantine.samples) + len(quarantine.fingerprints))
    clipped = clipped_norm(trainer, reading)
    if clipped is not None:
        out[keys.GRAD_NORM_CLIPPED] = clipped
    if reading is not None and reading.norms is not None and layers:
        names, values = layer_norms(reading.index, reading.norms)
        out.update({f"{keys.LAYER_GRAD_NORM}/{n}": v for n, v in zip(names, values.tolist(), strict=True)})
        if histogram:
            # Only the finite norms: a histogram of NaN/inf has no bins (TensorBoard refuses it), and a non-finite
            # step is counted in nanguard/nonfinite_steps already. A step with none finite has no histogram.
            norms = reading.norms.tensor_norms
            finite = norms[torch.isfinite(norms)]
            if finite.numel():
                emit.log_histogram(trainer, keys.GRAD_NORM_HIST, finite)
    return out


def layers_due(trainer: pl.Trainer, layer_depth: int | None, every_n_steps: int | None, histogram: bool) -> bool:
    """The per-layer norms (or the histogram) are due at this logging step."""
    if layer_depth is None and not histogram:
        return False
    if every_n_steps is None:
        return True  # called on Lightning's logging steps
    return (_lightning_compat.log_step(trainer) + 1) % every_n_steps == 0


def clipped_norm(trainer: pl.Trainer, reading: Reading | None) -> float | None:
    """The total norm after the Trainer's clipping, where it clips (``None`` otherwise)."""
    clip = trainer.gradient_clip_val
    if not clip or reading is None or reading.dropped or not reading.has_grads:
        return None
    if trainer.gradient_clip_algorithm in (None, "norm"):
        # torch's clip_grad_norm_: coef = clip / (norm + 1e-6), clamped to 1: the post-clip norm, no pass needed.
        return reading.grad_norm * min(1.0, float(clip) / (reading.grad_norm + 1e-6))
    # Value clipping: the clipped gradients are still on the parameters (zero_grad runs in the next closure).
    # Sharded parameters: the global norm (a collective; this runs on every rank, on logging steps).
    return current_grad_norm(trainer, reading.index)
