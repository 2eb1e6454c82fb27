"""Which of AutoRollback's snapshots are sound, judged after the fact, and whether the run is diverging now.

A snapshot is verified finite when it is taken, but finite is not healthy: a run that diverges slowly (a learning
rate past the stability edge) is finite for many steps while its loss grows by orders of magnitude, and a snapshot
taken then is a state training cannot come back from. So each snapshot is also judged, after the fact, by the reading
the engine already made of its own step (the loss and gradient norm of exactly those weights; no extra host read):
``SnapshotJudge``. A restore passes over snapshots judged to be taken mid-divergence (``rollback.choose_sound``).

``SnapshotBook`` is AutoRollback's record over a fit: when a snapshot is due, which one the ring must keep, the
verdicts on the snapshots taken, and whether the run is diverging now (the snapshot just judged unsound, confirmed by
the steps around it and the last sound one: ``diverging_now``).

Pure: step numbers and host floats in, decisions out. No Lightning, no tensors.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from lightning_nanguard.contract import Divergence, StepHealth
from lightning_nanguard.policies.rollback import snapshot_due

__all__ = [
    "CONFIRM_WINDOW",
    "DIVERGED_FACTOR",
    "History",
    "SnapshotBook",
    "SnapshotJudge",
    "diverged",
    "diverging_now",
]

# A snapshot whose step's gradient norm and loss are both more than this many times those of the last sound snapshot
# was taken mid-divergence. An order of magnitude in both at once is far outside batch-to-batch noise, and a diverging
# run passes it within a few steps (its loss grows geometrically).
DIVERGED_FACTOR = 10.0


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


# The engine's reading of a finite step: ``(step, grad_norm, loss)``.
History = Sequence[tuple[int, float, float | None]]


@dataclass
class SnapshotBook:
    """AutoRollback's record of its snapshots over one fit.

    Each snapshot is judged by the engine's reading of its own step once that reading is in the history (``score``:
    at a later batch's start, since the device path reports a step late). The newest one judged taken
    mid-divergence, confirmed by ``diverging_now``, raises ``diverging``: the engine handles that event at the
    batch's start. A snapshot waits ``quiet_steps`` after an incident that distrusts the state (``distrust``).

    Args:
        every_n_steps: the snapshot cadence.
        quiet_steps: no snapshot within this many steps after an incident that distrusts the state.
    """

    every_n_steps: int
    quiet_steps: int
    judge: SnapshotJudge = field(default_factory=SnapshotJudge)
    unscored: list[int] = field(default_factory=list)  # snapshots whose step reading has not reached the history yet
    last_incident: int | None = None  # the last step of an incident that distrusts the state
    diverging: bool = False  # the snapshot just judged was taken mid-divergence: not reported to the engine yet

    def reset(self) -> None:
        """A new fit: nothing judged, nothing pending."""
        self.judge.reset()
        self.unscored = []
        self.last_incident = None
        self.diverging = False

    def due(self, step: int, kept: Collection[int]) -> bool:
        """A snapshot is due at ``step`` (``kept``: the steps of the snapshots in the ring)."""
        return snapshot_due(
            step,
            every_n_steps=self.every_n_steps,
            last_snapshot_step=max(kept, default=None),
            last_incident_step=self.last_incident,
            quiet_steps=self.quiet_steps,
        )

    def keep(self, kept: Collection[int]) -> int | None:
        """The snapshot the ring must not evict for a new one: the newest sound one, while the ones after it were
        taken mid-divergence."""
        return max((s for s in kept if s not in self.judge.unsound), default=None)

    def taken(self, step: int, kept: Collection[int]) -> None:
        """A snapshot of ``step`` was taken; ``kept``: the ring's steps now (the verdicts of evicted ones go)."""
        self.judge.keep_only(kept)
        self.unscored.append(step)

    def score(self, now: int, history: History, kept: Collection[int]) -> bool:
        """Judge the pending snapshots whose step reading is in ``history`` (host floats the engine keeps anyway).

        Returns whether the newest snapshot in the ring (``kept``) was just judged taken mid-divergence and the steps
        around it and the last sound one confirm it (``diverging_now``): the run is diverging now. The readings are
        rank-reduced, so every rank returns the same. A snapshot with no finite reading of its step is sound: nothing
        says otherwise.
        """
        pending, self.unscored = self.unscored, []
        newest = history[-1][0] if history else -1
        latest = max(kept, default=None)
        diverging = False
        for step in pending:
            found = next((StepHealth(float(g), loss) for s, g, loss in history if s == step), None)
            if found is None and newest <= step and now - step <= self.every_n_steps:
                self.unscored.append(step)  # not read yet (the device path reports a step late)
                continue
            prev = self.judge.previous_step
            quiet = self.last_incident is None or prev is None or self.last_incident < prev
            sound = self.judge.judge(step, found, incident_since_previous=not quiet)
            if not sound and step == latest and self.judge.last_divergence is not None:
                diverging = diverging_now(self.judge.last_divergence, history)
        return diverging

    def settle(self, now: int, history: History, kept: Collection[int]) -> None:
        """Before a restore: judge what is pending; a divergence not yet reported is answered by the restore itself
        (it passes over the snapshot judged so)."""
        self.diverging = False
        if self.unscored:
            self.score(now, history, kept)

    def distrust(self, step: int) -> None:
        """An incident at ``step`` distrusts the state: the next snapshot waits ``quiet_steps``."""
        self.last_incident = max(self.last_incident or 0, step)

    def restored(self, step: int, restored_step: int) -> None:
        """At ``step`` the state of ``restored_step`` was restored: later verdicts belong to the abandoned
        trajectory, and the rollback is itself an incident."""
        self.judge.restored(restored_step)
        self.unscored = [s for s in self.unscored if s <= restored_step]
        self.last_incident = step
