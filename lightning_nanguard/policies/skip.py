"""The consecutive-bad-step budget behind ``GradNormMonitor(on_nonfinite=..., max_consecutive_skips=...)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_nanguard.policies.verdict import Action

__all__ = ["SkipBudget"]

OnNonFinite = Literal["warn", "skip", "stop"]


@dataclass
class SkipBudget:
    """Decide what to do with a step from whether it was bad, and keep the streak of consecutive bad steps.

    Args:
        on_nonfinite: ``"warn"`` lets the update through (it will poison the weights) and only reports;
            ``"skip"`` drops the update; ``"stop"`` drops the update and stops training.
        max_consecutive_skips: bad steps in a row allowed before training stops with an error.
        scaler_skips: the GradScaler already drops non-finite updates, so a bad step becomes ``SCALER_SKIP``
            (counted, never acted on twice).
    """

    on_nonfinite: OnNonFinite = "skip"
    max_consecutive_skips: int = 20
    streak: int = 0
    total_bad: int = 0

    def decide(self, bad: bool, *, scaler_skips: bool) -> Action:
        """The action for one step; updates the streak. ``STOP`` once the streak exceeds the budget."""
        if not bad:
            self.streak = 0
            return Action.NONE
        self.streak += 1
        self.total_bad += 1
        if self.on_nonfinite == "stop" or self.streak > self.max_consecutive_skips:
            return Action.STOP
        if scaler_skips:
            return Action.SCALER_SKIP
        if self.on_nonfinite == "warn":
            return Action.WARN
        return Action.SKIP

    @property
    def budget_left(self) -> int:
        return max(0, self.max_consecutive_skips - self.streak)
