"""DeepSpeed's own step, read from the outside: its fp16 loss scaler, its overflow skip, its global grad norm.

Under ``DeepSpeedStrategy`` the DeepSpeed engine owns the optimizer step. Lightning calls ``engine.backward`` and
then ``engine.step()``; ``on_before_optimizer_step`` runs between the two, when ZeRO has already moved the
gradients into its own partitioned buffers (``param.grad`` is not what the optimizer will use). Inside
``engine.step()`` DeepSpeed's optimizer wrapper checks the gradients for inf/NaN (always under fp16; under bf16 only
with ``"bf16": {"check_grad_overflow": true}``; never under fp32), all-reduces that flag (MAX) over the data-parallel
group, updates its loss scaler, and drops the update when it overflowed; otherwise it computes the global grad norm
(all-reduced too), unscales, clips and steps. So everything here is read *after* ``engine.step()``, and what it reads
is already identical on every rank: the overflow flag and the norm are DeepSpeed's reduced values, and the loss
scaler runs the same update on every rank.

Pure adapters and texts, no Trainer: the engine's DeepSpeed watches (``parts/deepspeed_sensing.py``) call them once
per step, and the incident path writes an event's message with the ``*_message`` functions, given the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_nanguard.contract import Action, Plan, StopReason

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "MIN_SCALE_EXIT",
    "DeepSpeedScaler",
    "StepOutcome",
    "collapse_advice",
    "collapse_message",
    "exit_message",
    "find_scaler",
    "is_min_scale_exit",
    "min_scale_exit_explanation",
    "overflow_message",
    "read_step",
]

# The message DeepSpeed's DynamicLossScaler raises (runtime/fp16/loss_scaler.py) when a step overflows while the
# scale already sits at its min_scale: "Current loss scale already at minimum - cannot decrease scale anymore.
# Exiting run." (a bare ``Exception``, from inside ``engine.step()``).
MIN_SCALE_EXIT = "Current loss scale already at minimum"


def is_min_scale_exit(exception: BaseException) -> bool:
    """``exception`` is DeepSpeed's "loss scale already at minimum ... Exiting run" (or wraps it): the bare
    ``Exception`` DeepSpeed raises, not an error of nanguard's that quotes it."""
    seen: set[int] = set()
    current: BaseException | None = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current) is Exception and MIN_SCALE_EXIT in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


class DeepSpeedScaler:
    """One DeepSpeed dynamic fp16 loss scaler behind one interface.

    DeepSpeed keeps its scale in two shapes: ZeRO (stages 1-3) holds a ``DynamicLossScaler`` as
    ``optimizer.loss_scaler`` (``cur_scale``, ``min_scale``; it raises ``MIN_SCALE_EXIT`` when a step overflows at
    ``min_scale`` while ``raise_error_at_min_scale`` is set, which DeepSpeed's config never clears); the non-ZeRO
    fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) hold a ``LossScaleConfig`` as
    ``optimizer.loss_scale_config`` (``cur_scale``, ``min_loss_scale``; they clamp at the minimum and never raise).
    The scale is a Python float in both: reading or setting it is no device work.
    """

    def __init__(self, holder: Any, kind: str) -> None:
        self.holder = holder
        self.kind = kind  # "zero" (DynamicLossScaler) or "fp16_optimizer" (LossScaleConfig)

    @property
    def scale(self) -> float:
        return float(self.holder.cur_scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self.holder.cur_scale = value

    @property
    def min_scale(self) -> float:
        """DeepSpeed's own floor (``fp16.min_loss_scale``; Lightning's ``DeepSpeedStrategy(min_loss_scale=1)``)."""
        value = self.holder.min_scale if self.kind == "zero" else self.holder.min_loss_scale
        return float(value)

    @property
    def raises_at_min(self) -> bool:
        """DeepSpeed ends the run with ``MIN_SCALE_EXIT`` at an overflow at its floor (ZeRO only)."""
        return self.kind == "zero" and bool(getattr(self.holder, "raise_error_at_min_scale", False))

    @raises_at_min.setter
    def raises_at_min(self, value: bool) -> None:
        if self.kind == "zero":
            self.holder.raise_error_at_min_scale = bool(value)

    def clamp(self, low: float, high: float | None) -> bool:
        """Hold the scale in ``[low, high]`` (``high=None``: no cap). True when it was moved."""
        scale = self.scale
        target = max(scale, low)
        if high is not None:
            target = min(target, high)
        if target == scale:
            return False
        self.scale = target
        return True


def find_scaler(optimizer: Any) -> DeepSpeedScaler | None:
    """The dynamic fp16 loss scaler of DeepSpeed's optimizer wrapper (``engine.optimizer``), or ``None``: no fp16,
    or a static loss scale (``fp16.loss_scale > 0``), where there is nothing to watch or floor."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = getattr(optimizer, "loss_scaler", None)
    if isinstance(scaler, DynamicLossScaler):
        return DeepSpeedScaler(scaler, "zero")
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None and getattr(config, "use_grad_scaling", False) and config.dynamic_loss_scale:
        return DeepSpeedScaler(config, "fp16_optimizer")
    return None


@dataclass(frozen=True)
class StepOutcome:
    """What ``engine.step()`` did, read right after it (identical on every rank).

    Attributes:
        step: DeepSpeed's optimizer-step counter after this step (``engine.global_steps``).
        overflow: DeepSpeed found inf/NaN gradients and dropped the update itself (fp16; bf16 with
            ``check_grad_overflow``); the flag was all-reduced (MAX) by DeepSpeed, so every rank has it.
        applied: ``engine.was_step_applied()``: the parameters were updated.
        grad_norm: the engine's global (all-reduced) unscaled pre-clip gradient norm of this step; ``inf`` on an
            overflow step (DeepSpeed found the gradients non-finite and computed no norm: its cached value is the
            previous step's, never reported); ``nan`` where DeepSpeed computes none (fp32 without ZeRO).
        norm_known: ``grad_norm`` came from DeepSpeed (not an overflow stand-in, not missing).
        skipped_total: DeepSpeed's cumulative skipped steps (``engine.skipped_steps``).
    """

    step: int
    overflow: bool
    applied: bool
    grad_norm: float
    norm_known: bool
    skipped_total: int

    @property
    def nonfinite(self) -> bool:
        return not math.isfinite(self.grad_norm)


def read_step(ds_engine: Any) -> StepOutcome:
    """Read the outcome of the last ``engine.step()``: at most one host read (the norm, when DeepSpeed keeps it as a
    device tensor); the overflow flag is a Python bool DeepSpeed already read."""
    optimizer = getattr(ds_engine, "optimizer", None)
    overflow = bool(getattr(optimizer, "overflow", False))
    applied = bool(ds_engine.was_step_applied())
    norm: float | Tensor | None = None if overflow else ds_engine.get_global_grad_norm()
    if overflow:
        grad_norm, known = math.inf, False
    elif norm is None:
        grad_norm, known = math.nan, False
    else:
        grad_norm, known = float(norm), True  # the step's one host read (a 0-d tensor under ZeRO)
    return StepOutcome(
        step=int(ds_engine.global_steps),
        overflow=overflow,
        applied=applied,
        grad_norm=grad_norm,
        norm_known=known,
        skipped_total=int(getattr(ds_engine, "skipped_steps", 0)),
    )


def collapse_advice(*, weights_finite: bool | None) -> str:
    """What a DeepSpeed fp16 loss-scale collapse means and what to try (the incident's and the error's text)."""
    if weights_finite is False:
        cause = (
            "the parameters are already non-finite, so every step overflows whatever the scale (check the checkpoint "
            "the run resumed from, or the step before the first overflow)"
        )
    else:
        cause = (
            "the gradients are inf/NaN even at the smallest loss scale, so the problem is not loss scaling: the loss "
            "is exploding (learning rate too high, no warmup), a batch holds bad values, or an activation exceeds "
            "fp16's range (65504) in the forward"
        )
    return (
        f"Every step overflowed down to the floor: {cause}. Try a lower learning rate or a warmup, DeepSpeed's "
        "'gradient_clipping', precision='bf16-mixed' (no loss scaling), or resuming from an earlier checkpoint; "
        "raising DeepSpeed's 'min_loss_scale' or 'hysteresis' only postpones the exit."
    )


def min_scale_exit_explanation(*, scale: float | None, min_scale: float | None) -> str:
    """DeepSpeed's own exit (``MIN_SCALE_EXIT``), explained."""
    at = "" if scale is None else f" (scale {scale:g}, DeepSpeed's min_loss_scale {min_scale:g})"
    return (
        f"DeepSpeed stopped the run: 'Current loss scale already at minimum - cannot decrease scale anymore. Exiting "
        f"run.' means a step overflowed in fp16 while DeepSpeed's dynamic loss scale already sat at its "
        f"min_loss_scale{at}, after hysteresis had run out: DeepSpeed cannot skip it by lowering the scale again, so "
        "it raises. " + collapse_advice(weights_finite=None) + " LossScaleWatchdog with floor_patience or "
        "max_overflow_streak set takes this decision over from DeepSpeed (an incident, and a stop that says why)."
    )


def collapse_message(
    plan: Plan,
    *,
    step: int,
    reason: str,
    skipped_total: int,
    weights_finite: bool | None,
    on_collapse: str,
    collapses: int,
    max_collapses: int | None,
) -> str:
    """A collapse of DeepSpeed's fp16 loss scale that LossScaleWatchdog took over, and what ``plan`` does about it."""
    if Action.WARN in plan.actions:
        then = "Kept training (on_collapse='warn'); DeepSpeed keeps skipping the overflowing updates."
    elif plan.stop is StopReason.COLLAPSE_BUDGET:
        then = f"Training stops: this is collapse {collapses}, over max_collapses={max_collapses}."
    else:
        then = (
            f"Training stops (on_collapse={on_collapse!r}; a rollback is not available under DeepSpeed, whose "
            "optimizer state AutoRollback cannot restore)."
        )
    return (
        f"nanguard: DeepSpeed's fp16 loss scale collapsed at step {step}: {reason}; DeepSpeed dropped each of "
        f"those updates itself (skipped_steps={skipped_total}). Without the watchdog DeepSpeed would "
        "have ended the run with 'Current loss scale already at minimum - cannot decrease scale anymore. "
        f"Exiting run.' {collapse_advice(weights_finite=weights_finite)} {then}"
    )


def overflow_message(
    plan: Plan, *, step: int, skipped_total: int, forced_check: bool, streak: int, max_skips: int | None
) -> str:
    """An update DeepSpeed dropped for inf/NaN gradients, and, where ``plan`` stops, why."""
    message = (
        f"nanguard: step {step}: DeepSpeed found inf/NaN gradients and dropped the update itself (its overflow "
        f"check, all-reduced over the ranks; DeepSpeed's skipped_steps={skipped_total}); nanguard counted it."
    )
    if forced_check:
        message += " (DeepSpeed checks bf16 gradients because GradNormMonitor set its check_grad_overflow.)"
    if plan.stop is not None:
        message += (
            f" That is {streak} dropped updates in a row (max_consecutive_skips={max_skips}): training stops. Under "
            "fp16 add LossScaleWatchdog, which judges overflow streaks against the loss scale; lower the learning "
            "rate or use precision='bf16-mixed'."
        )
    return message


def exit_message(plan: Plan, *, scale: float | None, min_scale: float | None) -> str:
    """DeepSpeed's own exit at its minimum loss scale, explained (it ended the run: ``plan`` records that)."""
    return "nanguard: " + min_scale_exit_explanation(scale=scale, min_scale=min_scale)
