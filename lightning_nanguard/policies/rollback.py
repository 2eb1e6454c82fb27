"""The rollback policy behind ``AutoRollback``: when to snapshot, which snapshot to restore, the budget, and the
batches skipped after a rollback.

Which snapshots are sound (not taken mid-divergence) is judged in ``snapshot_health.py``; ``choose_sound`` takes
that verdict. Pure: step numbers in, decisions out. No Lightning, no tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RollbackDecision", "RollbackPolicy", "choose_sound", "snapshot_due"]


def snapshot_due(
    step: int,
    *,
    every_n_steps: int,
    last_snapshot_step: int | None,
    last_incident_step: int | None,
    quiet_steps: int,
    jumped: bool = False,
) -> bool:
    """A snapshot is due on every ``every_n_steps``-th step and on a step whose learning rate ``jumped``, once, and
    only ``quiet_steps`` after the last incident."""
    if (step % every_n_steps != 0 and not jumped) or step == last_snapshot_step:
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
    """Rollback budget, recurrence handling, and the batches skipped after a rollback.

    Args:
        max_rollbacks: rollbacks allowed within any ``window`` consecutive steps.
        window: the budget window, in optimizer steps.
        recurrence_steps: a trigger within this many steps of the previous rollback counts as a recurrence: the
            snapshot restored then led straight back into trouble, so an older one is used.
        skip_batches: batches after each rollback whose updates are dropped (PaLM's recipe).
    """

    max_rollbacks: int = 5
    window: int = 1000
    recurrence_steps: int = 50
    skip_batches: int = 0
    history: list[int] = field(default_factory=list)  # steps at which rollbacks happened (within the window)
    total: int = 0
    last_restored_step: int | None = None
    skip_left: int = 0  # batches still to skip after the last rollback
    skipped_batches: int = 0  # batches skipped after rollbacks, in total

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
        self.skip_left = self.skip_batches

    def skip_batch(self) -> bool:
        """Whether this batch's update is dropped (one of the ``skip_batches`` after a rollback); counts it."""
        if self.skip_left <= 0:
            return False
        self.skip_left -= 1
        self.skipped_batches += 1
        return True

    @property
    def budget_left(self) -> int:
        return max(0, self.max_rollbacks - len(self.history))

    def budget_left_at(self, step: int) -> int:
        """Rollbacks still allowed at ``step`` (those within the window before it count)."""
        return max(0, self.max_rollbacks - sum(1 for s in self.history if step - s < self.window))

    def state_dict(self) -> dict[str, Any]:
        """The counters (primitives: loadable with ``weights_only=True``)."""
        return {
            "rollbacks": self.total,
            "history": list(self.history),
            "last_restored_step": self.last_restored_step,
            "skipped_batches": self.skipped_batches,
            "skip_left": self.skip_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s counters; a key missing from an older state reads as its initial value."""
        self.total = int(state.get("rollbacks", 0))
        self.history = [int(s) for s in state.get("history", [])]
        last = state.get("last_restored_step")
        self.last_restored_step = None if last is None else int(last)
        self.skipped_batches = int(state.get("skipped_batches", 0))
        self.skip_left = int(state.get("skip_left", 0))


def choose_sound(
    decision: RollbackDecision, available: Sequence[int], unsound: Collection[int]
) -> tuple[int | None, tuple[int, ...]]:
    """The snapshot to restore, passing over those taken mid-divergence, and the ones passed over (newest first).

    Among the snapshots ``RollbackPolicy.choose`` may pick from (all, or those before ``decision.older_than``), the
    newest sound one. When none is sound, the plain choice (a finite state still beats a non-finite one).
    """
    eligible = [s for s in available if decision.older_than is None or s < decision.older_than]
    sound = [s for s in eligible if s not in unsound]
    if not sound:
        return max(eligible, default=None), ()
    chosen = max(sound)
    return chosen, tuple(sorted((s for s in eligible if s > chosen), reverse=True))
