"""The learning rates behind each kept snapshot: the rate it was taken at, and the rate its state trained at. Pure.

A backoff after a divergence holds the rate at a cap (``policies.backoff``): below the rate the step that diverged ran
with, and where the rollback restored a state that had trained soundly at a known rate, not above that rate. That
rate is what this ledger keeps. A snapshot is taken at a batch start, so the rate in the optimizer then is the one
the *next* step will run with, which the snapshot's state has never trained at (a 10x jump at the snapshot's step
would pass for a sound rate); and a snapshot at the start of a fit has trained at nothing. So each step's rate is
observed at its batch start, and a snapshot's *trained* rate is the lowest rate of the ``PROVEN_STEPS`` steps before
it, kept only when there were that many since the start of the fit (or the state a rollback restored) and they held
within a factor ``RATE_JUMP`` of each other: the state had trained that long at about that rate when the probe found
it sound. Not the lowest since the snapshot before, nor over a window a steep warmup runs through: that would be the
warmup's first rate, which says nothing about the rates the state trained at last.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = ["PROVEN_STEPS", "RATE_JUMP", "RestoredRates", "SnapshotRates"]

# A step whose rate is this many times the step before's is a jump (a warm restart, a stepped schedule, a rate set
# by hand): a snapshot is taken before it, of the state that trained at the old rate.
RATE_JUMP = 2.0
# Steps at a rate before a snapshot that make its state's soundness evidence for the rate: a rate past the stability
# edge shows in the probe within a few steps of a jump, and the spike detector's own warmup is as long.
PROVEN_STEPS = 10


@dataclass(frozen=True)
class RestoredRates:
    """What the kept snapshots up to a restored one say about the rates its state can train at.

    Attributes:
        taken: the lowest rate they were taken at (``None``: none known).
        trained: the lowest rate they had trained at over their last ``PROVEN_STEPS`` steps (``None``: none had that
            many, held within ``RATE_JUMP``). The lowest, not the newest's: the newest may have been taken as a climb
            began, before the probe had risen enough to say so.
    """

    taken: float | None = None
    trained: float | None = None


@dataclass
class SnapshotRates:
    """Each kept snapshot's rates, from the rates observed at every batch start."""

    taken: dict[int, float | None] = field(default_factory=dict)  # snapshot step -> the rate when it was taken
    trained: dict[int, float] = field(default_factory=dict)  # snapshot step -> the lowest rate of its last steps
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=PROVEN_STEPS))  # the last steps' rates

    def reset(self) -> None:
        self.taken.clear()
        self.trained.clear()
        self.recent.clear()

    def observe(self, rate: float | None) -> None:
        """A step begins and will run with ``rate`` (``None``: not a host number, so no rate is known for a while)."""
        if rate is None or not math.isfinite(rate) or rate <= 0:
            self.recent.clear()
        else:
            self.recent.append(rate)

    def jumped(self, rate: float | None) -> bool:
        """``rate``, the rate the step beginning now will run with, jumped: ``RATE_JUMP`` x the last step's or more,
        after ``PROVEN_STEPS`` steps of training (the first steps of a warmup that starts low are no jump)."""
        recent = self.recent
        return rate is not None and len(recent) == PROVEN_STEPS and rate >= RATE_JUMP * recent[-1]

    def snapshot(self, step: int, rate: float | None, kept: Collection[int]) -> None:
        """The snapshot of ``step`` was taken (before that step's rate is observed); ``kept``: the steps kept now."""
        self.taken = {s: r for s, r in self.taken.items() if s in kept}
        self.trained = {s: r for s, r in self.trained.items() if s in kept}
        self.taken[step] = rate
        low = self._steady()
        if low is not None:
            self.trained[step] = low

    def restored(self, step: int) -> None:
        """The state of the snapshot of ``step`` was restored: the steps since belong to an abandoned trajectory."""
        self.recent.clear()

    def at(self, up_to: int) -> RestoredRates:
        """The rates of the kept snapshots up to ``up_to`` (the one a rollback restored)."""
        taken = [r for s, r in self.taken.items() if s <= up_to and r is not None]
        trained = [r for s, r in self.trained.items() if s <= up_to]
        return RestoredRates(min(taken, default=None), min(trained, default=None))

    def _steady(self) -> float | None:
        """The lowest rate of the last ``PROVEN_STEPS`` steps, where there were that many and they held within a
        factor ``RATE_JUMP`` of each other (``None`` otherwise)."""
        if len(self.recent) < PROVEN_STEPS:
            return None
        low = min(self.recent)
        return low if max(self.recent) < RATE_JUMP * low else None
