"""The rollback policy behind ``AutoRollback``: when to snapshot, which snapshot to restore, and the budget.

Pure: step numbers in, decisions out. No Lightning, no tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["RollbackDecision", "RollbackPolicy", "snapshot_due"]


def snapshot_due(
    step: int, *, every_n_steps: int, last_snapshot_step: int | None, last_incident_step: int | None, quiet_steps: int
) -> bool:
    """A snapshot is due on every ``every_n_steps``-th step, once, and only ``quiet_steps`` after the last incident."""
    if step % every_n_steps != 0 or step == last_snapshot_step:
        return False
    return last_incident_step is None or step - last_incident_step > quiet_steps


@dataclass(frozen=True)
class RollbackDecision:
    """What to do about a rollback trigger at ``step``.

    Attributes:
        exhausted: this rollback is one more than ``max_rollbacks`` within ``window`` steps: restore, then stop.
        recurrence: the trigger came within ``recurrence_steps`` of the previous rollback.
        older_than: restore the newest snapshot taken strictly before this step (``None``: the newest one).
        in_window: rollbacks within the window, this one included.
    """

    exhausted: bool
    recurrence: bool
    older_than: int | None
    in_window: int


@dataclass
class RollbackPolicy:
    """Rollback budget and recurrence handling.

    Args:
        max_rollbacks: rollbacks allowed within any ``window`` consecutive steps.
        window: the budget window, in optimizer steps.
        recurrence_steps: a trigger within this many steps of the previous rollback counts as a recurrence: the
            snapshot restored then led straight back into trouble, so an older one is used.
    """

    max_rollbacks: int = 5
    window: int = 1000
    recurrence_steps: int = 50
    history: list[int] = field(default_factory=list)  # steps at which rollbacks happened (within the window)
    total: int = 0
    last_restored_step: int | None = None

    def decide(self, step: int) -> RollbackDecision:
        recent = [s for s in self.history if step - s < self.window]
        last = self.history[-1] if self.history else None
        recurrence = last is not None and step - last <= self.recurrence_steps
        return RollbackDecision(
            exhausted=len(recent) + 1 > self.max_rollbacks,
            recurrence=recurrence,
            older_than=self.last_restored_step if recurrence else None,
            in_window=len(recent) + 1,
        )

    @staticmethod
    def choose(decision: RollbackDecision, available: Sequence[int]) -> int | None:
        """The snapshot step to restore among ``available``; ``None`` when none fits (go to disk)."""
        if decision.older_than is None:
            return max(available, default=None)
        return max((s for s in available if s < decision.older_than), default=None)

    def record(self, step: int, restored_from: int) -> None:
        self.history = [s for s in self.history if step - s < self.window] + [step]
        self.total += 1
        self.last_restored_step = restored_from

    @property
    def budget_left(self) -> int:
        return max(0, self.max_rollbacks - len(self.history))
