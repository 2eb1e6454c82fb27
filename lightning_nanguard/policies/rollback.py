"""The rollback policy behind ``AutoRollback``: when to snapshot, which snapshot to restore, and the budget.

A snapshot is verified finite when it is taken, but finite is not healthy: a run that diverges slowly (a learning
rate past the stability edge) is finite for many steps while its loss grows by orders of magnitude, and a snapshot
taken then is a state training cannot come back from. So each snapshot is also judged, after the fact, by the reading
the engine already made of its own step (the loss and gradient norm of exactly those weights; no extra host read):
``SnapshotJudge``. A restore passes over snapshots judged to be taken mid-divergence (``choose_sound``).

Pure: step numbers and host floats in, decisions out. No Lightning, no tensors.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from lightning_nanguard.contract import Divergence, StepHealth

__all__ = [
    "DIVERGED_FACTOR",
    "RollbackDecision",
    "RollbackPolicy",
    "SnapshotJudge",
    "choose_sound",
    "diverged",
    "diverging_now",
    "snapshot_due",
]

# A snapshot whose step's gradient norm and loss are both more than this many times those of the last sound snapshot
# was taken mid-divergence. An order of magnitude in both at once is far outside batch-to-batch noise, and a diverging
# run passes it within a few steps (its loss grows geometrically).
DIVERGED_FACTOR = 10.0


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


def _above(value: float | None, reference: float | None, factor: float) -> bool | None:
    """``value > factor * reference``; ``None`` when the pair is not comparable (missing, non-finite, not positive)."""
    if value is None or reference is None or not (math.isfinite(value) and math.isfinite(reference)):
        return None
    if reference <= 0.0 or value <= 0.0:  # a loss can be negative (log-likelihoods): a ratio means nothing then
        return None
    return value > factor * reference


def diverged(health: StepHealth, reference: StepHealth, factor: float = DIVERGED_FACTOR) -> bool:
    """``health`` is more than ``factor`` x ``reference`` in gradient norm and in loss (each where comparable; at least
    one must be, and every comparable one must be above)."""
    verdicts = [
        v
        for v in (
            _above(health.grad_norm, reference.grad_norm, factor),
            _above(health.loss, reference.loss, factor),
        )
        if v is not None
    ]
    return bool(verdicts) and all(verdicts)


@dataclass
class SnapshotJudge:
    """Which snapshots were taken mid-divergence, judged by each snapshot's own step reading.

    A snapshot is *sound* unless its reading ``diverged`` from the reference: the newest sound snapshot before it
    (kept after the snapshot itself is evicted). A snapshot without a reading (none was made, or the step was not
    finite) is sound: nothing says otherwise, and the old behaviour (newest first) is kept.

    A level that holds is a new normal, not a divergence (a diverging run keeps growing and ends in an incident): when
    a snapshot is within ``factor`` of an unsound previous one and no incident came between them, both are sound.

    Args:
        factor: see ``DIVERGED_FACTOR``.
    """

    factor: float = DIVERGED_FACTOR
    reference: StepHealth | None = None
    reference_step: int | None = None
    unsound: set[int] = field(default_factory=set)
    healths: dict[int, StepHealth] = field(default_factory=dict)  # readings of the judged snapshots still kept
    _previous: tuple[int, StepHealth, bool] | None = None  # the last judged snapshot: step, reading, sound
    last_divergence: Divergence | None = None  # the verdict behind the last snapshot judged unsound

    @property
    def previous_step(self) -> int | None:
        return None if self._previous is None else self._previous[0]

    def judge(self, step: int, health: StepHealth | None, *, incident_since_previous: bool = False) -> bool:
        """Judge the snapshot of ``step``; returns whether it is sound."""
        if health is None:
            return True
        self.healths[step] = health
        sound = self.reference is None or not diverged(health, self.reference, self.factor)
        prev = self._previous
        held = (
            prev is not None
            and not diverged(health, prev[1], self.factor)
            and not diverged(prev[1], health, self.factor)
        )
        if not sound and held and prev is not None and not prev[2] and not incident_since_previous:
            sound = True
            self.unsound.discard(prev[0])  # vindicated too (if it is still kept)
        if sound:
            self.reference, self.reference_step = health, step
        else:
            self.unsound.add(step)
            if self.reference is not None:
                self.last_divergence = Divergence(step, health, self.reference_step, self.reference, self.factor)
        self._previous = (step, health, sound)
        return sound

    def restored(self, step: int) -> None:
        """The state of ``step`` was restored: later verdicts belong to the abandoned trajectory."""
        self.unsound = {s for s in self.unsound if s <= step}
        self.healths = {s: h for s, h in self.healths.items() if s <= step}
        health = self.healths.get(step)
        if health is not None and step not in self.unsound:
            self.reference, self.reference_step = health, step
        self._previous = None if health is None else (step, health, step not in self.unsound)

    def keep_only(self, steps: Collection[int]) -> None:
        """Forget the verdicts of snapshots no longer kept (the reference stays)."""
        self.unsound &= set(steps)
        self.healths = {s: h for s, h in self.healths.items() if s in steps}

    def reset(self) -> None:
        self.reference, self.reference_step, self._previous, self.last_divergence = None, None, None, None
        self.unsound.clear()
        self.healths.clear()


# Steps read on each side for ``diverging_now``: the median of this many is not moved by one odd batch.
CONFIRM_WINDOW = 5


def _median(readings: Sequence[StepHealth]) -> StepHealth:
    losses = [h.loss for h in readings if h.loss is not None]
    return StepHealth(statistics.median(h.grad_norm for h in readings), statistics.median(losses) if losses else None)


def diverging_now(
    divergence: Divergence, history: Iterable[tuple[int, float, float | None]], window: int = CONFIRM_WINDOW
) -> bool:
    """A snapshot judged taken mid-divergence is worth acting on now (a rollback and a backoff, not only passing it
    over later): the median of the last ``window`` readings up to its step, against the median of those of the
    ``window`` steps from the last sound snapshot's, is ``diverged`` too.

    One reading on each side can be one odd batch: a hard batch at the snapshot, or an easy one at the reference
    (then every later snapshot reads 10x above it, and acting on each would roll a healthy run back until its budget
    ran out). A divergence lifts every step. ``history`` is the engine's ``(step, grad_norm, loss)`` of finite steps.
    Without readings near the reference, the reference's own reading stands in.
    """
    readings = [(s, StepHealth(float(g), loss)) for s, g, loss in history if s <= divergence.step]
    recent = [h for _, h in readings[-window:]]
    start = divergence.reference_step
    end = divergence.step if start is None else min(start + window, divergence.step)
    base = [h for s, h in readings if start is not None and start <= s < end]
    if not recent:
        return False
    return diverged(_median(recent), _median(base) if base else divergence.reference, divergence.factor)


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
