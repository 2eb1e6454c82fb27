"""When the fp16 loss scale has collapsed: the rule behind ``LossScaleWatchdog``. Pure: one bool per step in.

A collapse is either ``max_overflow_streak`` overflowing steps in a row, or ``floor_patience`` overflowing steps
while the scale already sits at the floor (the GradScaler would have lowered it further; counted until an overflow
happens above the floor). What to do about a collapse is the remedy policy's decision (``policies.remedy``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CollapseFacts", "CollapsePolicy"]


@dataclass(frozen=True)
class CollapseFacts:
    """A loss-scale collapse, as the watchdog saw it: why, the values behind it, the budget left."""

    reason: str
    values: dict[str, object]
    budget_left: int


@dataclass
class CollapsePolicy:
    """Count overflows and decide when the loss scale has collapsed.

    Args:
        floor_patience: overflows at the floor that make a collapse (``None``: never on this rule).
        max_overflow_streak: consecutive overflows that make a collapse (``None``: never on this rule).
        max_collapses: collapses handled before the next one stops training (``None``: unbounded).
        window: steps over which ``overflow_rate`` is computed.
    """

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

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.window)

    def observe(self, overflow: bool, at_floor: bool) -> bool:
        """One optimizer step: did it overflow, and was its scale already at the floor? True on a collapse."""
        self.recent.append(int(overflow))
        if overflow:
            self.overflow_steps += 1
            self.streak += 1
            # An overflow above the floor means the scale left it since the last hit: start counting afresh.
            self.floor_hits = self.floor_hits + 1 if at_floor else 0
        else:
            self.streak = 0
        if self.floor_patience is not None and self.floor_hits >= self.floor_patience:
            self.reason = (
                f"{self.floor_hits} overflowing steps with the scale already at its floor "
                f"(floor_patience={self.floor_patience})"
            )
        elif self.max_overflow_streak is not None and self.streak >= self.max_overflow_streak:
            self.reason = f"{self.streak} overflowing steps in a row (max_overflow_streak={self.max_overflow_streak})"
        else:
            return False
        self.collapses += 1
        return True

    def collapse(self, scale: float, floor: float, history: list[list[float]]) -> CollapseFacts:
        """The collapse ``observe`` just found, for its incident (``scale``: the step's; ``floor``: the floor it was
        judged against; ``history``: the scale's recent changes); the streaks then start afresh."""
        facts = CollapseFacts(
            self.reason.replace("at its floor", f"at its floor min_scale={floor:g}"),
            {**self.readings(), "loss_scale": scale, "min_scale": floor, "scale_history": history},
            self.budget_left,
        )
        self.reset_streaks()
        return facts

    def reset_streaks(self) -> None:
        """Start counting afresh: after a collapse was acted on, or after a rollback restored the state."""
        self.streak = 0
        self.floor_hits = 0

    @property
    def overflow_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    @property
    def budget_left(self) -> int:
        """Collapses the budget still covers, the current one included (``0``: it is one too many: stop)."""
        return 1 if self.max_collapses is None else self.max_collapses - (self.collapses - 1)

    def collapses_left(self) -> int | None:
        """Further collapses the budget allows (``None``: unlimited)."""
        return None if self.max_collapses is None else max(0, self.max_collapses - self.collapses)

    def readings(self) -> dict[str, object]:
        """The counters behind a collapse, for its incident record."""
        return {
            "overflow_streak": self.streak,
            "floor_hits": self.floor_hits,
            "overflow_steps": self.overflow_steps,
            "overflow_rate": self.overflow_rate,
            "collapses": self.collapses,
            "collapse_reason": self.reason,
        }

    def state_dict(self) -> dict[str, object]:
        """The counters, as primitives (``weights_only``-safe)."""
        return {
            "overflow_steps": self.overflow_steps,
            "streak": self.streak,
            "floor_hits": self.floor_hits,
            "collapses": self.collapses,
            "recent": list(self.recent),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; missing keys (older state) read as zero."""
        self.overflow_steps = int(state.get("overflow_steps", 0))
        self.streak = int(state.get("streak", 0))
        self.floor_hits = int(state.get("floor_hits", 0))
        self.collapses = int(state.get("collapses", 0))
        self.recent = deque((int(v) for v in state.get("recent", [])), maxlen=self.window)
