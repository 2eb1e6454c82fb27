"""The decisions behind ``LossScaleWatchdog``: a host mirror of the GradScaler, the collapse rule, the diagnosis.

No Lightning and no tensors here: the callback feeds in one bool per optimizer step (did it overflow?) and reads
back what to do. The GradScaler's schedule is deterministic given the overflow flags, so the mirror follows the
scale on the host without a device read; the callback re-reads the real scale only on logging steps and after an
overflow, where a host read is paid anyway.
"""

from __future__ import annotations

import math
import struct
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_nanguard.policies.verdict import Action

__all__ = ["CollapsePolicy", "Diagnosis", "ScaleMirror", "diagnose", "to_float32"]

OnCollapse = Literal["warn", "rollback", "stop"]


def to_float32(value: float) -> float:
    """``value`` rounded to float32, the dtype of the GradScaler's scale tensor."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:  # beyond float32's range: torch stores inf
        return math.copysign(math.inf, value)


@dataclass
class ScaleMirror:
    """The GradScaler's scale and growth tracker, kept on the host by replaying ``torch._amp_update_scale_``.

    torch computes ``scale * factor`` from the float32 scale and the Python (double) factor, then stores float32;
    growth is dropped when it would overflow to inf. The floor and the cap are applied afterwards, as the
    watchdog's in-place ``clamp_`` does on the device.
    """

    scale: float
    growth_tracker: int
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float | None = None

    def __post_init__(self) -> None:
        self.scale = to_float32(self.scale)

    @property
    def floor(self) -> float:
        return to_float32(self.min_scale)

    @property
    def at_floor(self) -> bool:
        return self.scale <= self.floor

    def update(self, overflow: bool) -> float:
        """Advance one ``scaler.update()`` and the clamp; returns the new scale."""
        if overflow:
            self.scale = to_float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = to_float32(self.scale * self.growth_factor)
                if math.isfinite(grown):
                    self.scale = grown
                self.growth_tracker = 0
        return self.clamp()

    def clamp(self) -> float:
        """Apply the floor and the cap (float32, as ``Tensor.clamp_`` does)."""
        if self.max_scale is not None:
            self.scale = min(self.scale, to_float32(self.max_scale))
        self.scale = max(self.scale, self.floor)
        return self.scale

    def resync(self, scale: float, growth_tracker: int) -> bool:
        """Adopt the scaler's real state; True if the mirror had drifted."""
        drifted = to_float32(scale) != self.scale or growth_tracker != self.growth_tracker
        self.scale, self.growth_tracker = to_float32(scale), int(growth_tracker)
        return drifted


@dataclass
class CollapsePolicy:
    """Count overflows and decide when the loss scale has collapsed.

    A collapse is either ``max_overflow_streak`` overflowing steps in a row, or ``floor_patience`` overflowing steps
    while the scale already sits at the floor (the GradScaler would have lowered it further; counted until an overflow
    happens above the floor). Each collapse costs one unit of ``max_collapses``; one more than the budget stops.

    Args:
        on_collapse: the action for a collapse within budget.
        floor_patience: overflows at the floor that make a collapse (``None``: never on this rule).
        max_overflow_streak: consecutive overflows that make a collapse (``None``: never on this rule).
        max_collapses: collapses tolerated before a stop (``None``: unbounded).
        window: steps over which ``overflow_rate`` is computed.
    """

    on_collapse: OnCollapse = "stop"
    floor_patience: int | None = 10
    max_overflow_streak: int | None = 30
    max_collapses: int | None = 3
    window: int = 100
    overflow_steps: int = 0
    streak: int = 0
    floor_hits: int = 0
    collapses: int = 0
    recent: deque[int] = field(default_factory=deque)
    reason: str = ""
    budget_exhausted: bool = False

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.window)

    def observe(self, overflow: bool, at_floor: bool) -> Action:
        """One optimizer step: did it overflow, and was the scale it used already at the floor?

        ``at_floor`` is read only for overflowing steps, so a caller need agree on it across ranks only there.
        """
        self.recent.append(int(overflow))
        if overflow:
            self.overflow_steps += 1
            self.streak += 1
            # An overflow above the floor means the scale left it since the last hit: start counting afresh.
            self.floor_hits = self.floor_hits + 1 if at_floor else 0
        else:
            self.streak = 0
        if self.floor_patience is not None and self.floor_hits >= self.floor_patience:
            self.reason = "floor"
        elif self.max_overflow_streak is not None and self.streak >= self.max_overflow_streak:
            self.reason = "streak"
        else:
            return Action.NONE
        return self._collapse()

    def _collapse(self) -> Action:
        self.collapses += 1
        self.budget_exhausted = self.max_collapses is not None and self.collapses > self.max_collapses
        if self.budget_exhausted or self.on_collapse == "stop":
            return Action.STOP
        return Action.ROLLBACK if self.on_collapse == "rollback" else Action.WARN

    def reset_streaks(self) -> None:
        """Start counting afresh: after a collapse was acted on, or after a rollback restored the state."""
        self.streak = 0
        self.floor_hits = 0

    def state_dict(self) -> dict[str, Any]:
        """The counters, as primitives (``weights_only``-safe)."""
        return {
            "overflow_steps": self.overflow_steps,
            "streak": self.streak,
            "floor_hits": self.floor_hits,
            "collapses": self.collapses,
            "recent": list(self.recent),
        }

    def readings(self) -> dict[str, Any]:
        """The counters behind a collapse, for its incident record."""
        return {
            "overflow_streak": self.streak,
            "floor_hits": self.floor_hits,
            "overflow_steps": self.overflow_steps,
            "overflow_rate": self.overflow_rate,
            "collapses": self.collapses,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; missing keys (older state) read as zero."""
        self.overflow_steps = int(state.get("overflow_steps", 0))
        self.streak = int(state.get("streak", 0))
        self.floor_hits = int(state.get("floor_hits", 0))
        self.collapses = int(state.get("collapses", 0))
        self.recent = deque((int(v) for v in state.get("recent", [])), maxlen=self.window)

    def describe(
        self,
        action: Action,
        *,
        step: int,
        epoch: int,
        scale: float,
        min_scale: float,
        history: Iterable[tuple[int, float]],
        advice: str,
    ) -> str:
        """The incident/error text of the collapse just decided: what, where, the scale history, the diagnosis."""
        if self.reason == "floor":
            why = (
                f"{self.floor_hits} overflowing steps with the scale already at its floor min_scale={min_scale:g} "
                f"(floor_patience={self.floor_patience}): the GradScaler cannot go lower, and skips every such step"
            )
        else:
            why = (
                f"{self.streak} overflowing steps in a row (max_overflow_streak={self.max_overflow_streak}); the "
                "GradScaler skipped every one of them"
            )
        steps = ", ".join(f"{s}: {v:g}" for s, v in history)
        head = (
            f"Loss-scale collapse at global_step={step} (epoch {epoch}): {why}. Scale now {scale:g}; recent scale "
            f"history (step: scale) {steps}. Diagnosis: {advice}"
        )
        left = "no collapse budget" if self.budget_left < 0 else f"{self.budget_left} more collapses allowed"
        if action is Action.WARN:
            tail = f"on_collapse='warn': training goes on and overflowing steps keep being skipped ({left})."
        elif action is Action.ROLLBACK:
            tail = f"on_collapse='rollback': this update was dropped and AutoRollback was asked to restore ({left})."
        elif self.budget_exhausted:
            tail = f"Training stopped: collapse {self.collapses} is more than max_collapses={self.max_collapses}."
        elif self.on_collapse == "rollback":
            tail = "Training stopped: on_collapse='rollback' but AutoRollback is not installed to restore a state."
        else:
            tail = "Training stopped (on_collapse='stop'); the GradScaler skipped the overflowing updates."
        return f"{head} {tail}"

    @property
    def overflow_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    @property
    def budget_left(self) -> int:
        return -1 if self.max_collapses is None else max(0, self.max_collapses - self.collapses)


@dataclass(frozen=True)
class Diagnosis:
    """What a collapse most likely means. ``kind`` is stable (for incident records); ``advice`` is for people."""

    kind: str
    advice: str


def diagnose(*, weights_finite: bool, finite_steps: int, resumed_from: str | None) -> Diagnosis:
    """Tell "the loss is exploding" apart from "the weights are already non-finite".

    Args:
        weights_finite: every parameter is finite now.
        finite_steps: steps of this fit (since its start or resume) that did not overflow.
        resumed_from: the checkpoint this fit resumed from (``trainer.ckpt_path``), if any.
    """
    ckpt = f"'{resumed_from}'" if resumed_from else None
    if not weights_finite:
        if ckpt and finite_steps == 0:
            return Diagnosis(
                "nonfinite_weights_from_checkpoint",
                f"the weights are already non-finite and no step has been finite since resuming from {ckpt}: that "
                "checkpoint most likely holds NaN/inf weights. Check it (torch.load it and test torch.isfinite on "
                "its state_dict) and resume from an earlier one; a lower learning rate will not help.",
            )
        return Diagnosis(
            "nonfinite_weights",
            "the weights are already non-finite (they were loaded that way or an update poisoned them before this "
            "step): no loss scale can recover from that. Restore an earlier checkpoint (AutoRollback does it in "
            "memory); a lower learning rate will not help.",
        )
    if finite_steps == 0:
        if ckpt:
            return Diagnosis(
                "overflow_since_resume",
                f"every step since resuming from {ckpt} overflowed although the weights are finite: check that "
                "checkpoint's optimizer and loss-scaler state, and the first batches the resumed run sees.",
            )
        return Diagnosis(
            "overflow_from_start",
            "every step overflowed from the first one although the weights are finite: the model overflows float16 "
            "at any scale. Check the inputs and the initialization, or train in bf16-mixed.",
        )
    return Diagnosis(
        "loss_exploding",
        f"the loss is exploding (the overflows started after {finite_steps} finite steps). Try lowering the "
        "learning rate, using gradient clipping or increasing the batch size.",
    )
