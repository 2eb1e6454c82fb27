"""Which of AutoRollback's snapshots are sound, judged after the fact, and whether the run is diverging now.

A snapshot is verified finite when it is taken, but finite is not healthy: a run that diverges slowly (a learning
rate past the stability edge) is finite for many steps while its loss grows by orders of magnitude, and a snapshot
taken then is a state training cannot come back from. So each snapshot is also judged, after the fact, by the reading
the engine already made of its own step (the loss and gradient norm of exactly those weights; no extra host read):
``SnapshotJudge``. A snapshot far above the last sound one is a *suspect*: a restore passes over it
(``rollback.choose_sound``) while it is one.

Height alone does not make a divergence: a new data domain, a curriculum stage or a fine-tuning switch lifts the loss
and the gradient norm 10-100x for a while, then they fall by themselves. A divergence is growth that does not turn, so
a suspect is decided on the trend of the readings after the jump (``GrowthWatch``): they keep growing (another
``GROWTH_FACTOR`` past the level where they first passed ``DIVERGED_FACTOR``, not fallen from their peak), and the run
is diverging now; they fall back, or fall from their peak, and the snapshot is sound after all; until then it stays a
suspect and nothing is done.

``SnapshotBook`` is AutoRollback's record over a fit: when a snapshot is due, which one the ring must keep, the
verdicts on the snapshots taken, and the watch on the newest suspect.

Pure: step numbers and host floats in, decisions out. No Lightning, no tensors.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from lightning_nanguard.contract import Divergence, StepHealth
from lightning_nanguard.policies.rollback import snapshot_due

__all__ = [
    "CONFIRM_WINDOW",
    "DIVERGED_FACTOR",
    "GROWTH_FACTOR",
    "TURN_FACTOR",
    "GrowthWatch",
    "History",
    "SnapshotBook",
    "SnapshotJudge",
    "Trend",
    "diverged",
    "read_trend",
]

# A snapshot whose step's gradient norm and loss are both more than this many times those of the last sound snapshot
# is a suspect. An order of magnitude in both at once is far outside batch-to-batch noise, and a diverging run passes
# it within a few steps (its loss grows geometrically); so does a new data domain, which is why the trend decides.
DIVERGED_FACTOR = 10.0
# Past the level at which the smoothed readings first passed ``DIVERGED_FACTOR``, a divergence grows on: the loss or
# the gradient norm by this much again (a squared error grows as the square of its gradient), and both by at least
# ``TURN_FACTOR``. A jump that plateaus or falls never does; a diverging run (growing geometrically) does in a few steps.
GROWTH_FACTOR = 10.0
# Smoothed readings fallen below 1/``TURN_FACTOR`` of their peak (either of them) have turned: a jump, not a divergence.
TURN_FACTOR = 2.0

# The engine's readings of finite steps: ``(step, grad_norm, loss)``.
History = Sequence[tuple[int, float, float | None]]


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
    """Which snapshots may have been taken mid-divergence, judged by each snapshot's own step reading.

    A snapshot is *sound* unless its reading ``diverged`` from the reference: the newest sound snapshot before it
    (kept after the snapshot itself is evicted). A snapshot without a reading (none was made, or the step was not
    finite) is sound: nothing says otherwise, and the old behaviour (newest first) is kept. An unsound snapshot is a
    suspect until the trend after it decides (``SnapshotBook``): ``vindicate`` makes it sound.

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

    def vindicate(self, step: int) -> None:
        """The snapshot of ``step`` is sound after all (what followed its jump turned). It does not become the
        reference: a reading taken at the top of a jump is no yardstick for the next snapshot."""
        self.unsound.discard(step)
        if self._previous is not None and self._previous[0] == step:
            self._previous = (step, self._previous[1], True)

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


# The readings smoothed by the trend: their median is not moved by one or two odd batches.
CONFIRM_WINDOW = 5


def _median(readings: Iterable[StepHealth]) -> StepHealth:
    readings = list(readings)
    losses = [h.loss for h in readings if h.loss is not None]
    return StepHealth(statistics.median(h.grad_norm for h in readings), statistics.median(losses) if losses else None)


def _grew(now: StepHealth, anchor: StepHealth, factor: float, least: float) -> bool:
    """Every comparable reading of ``now`` above ``least`` x ``anchor``'s, and one of them above ``factor`` x."""
    pairs = ((now.grad_norm, anchor.grad_norm), (now.loss, anchor.loss))
    comparable = [(_above(v, r, least), _above(v, r, factor)) for v, r in pairs if _above(v, r, least) is not None]
    return bool(comparable) and all(some for some, _ in comparable) and any(much for _, much in comparable)


def _peak(a: StepHealth, b: StepHealth) -> StepHealth:
    loss = b.loss if a.loss is None or (b.loss is not None and b.loss > a.loss) else a.loss
    return StepHealth(max(a.grad_norm, b.grad_norm), loss)


class Trend(enum.Enum):
    """What the readings after a suspect snapshot's jump did (``GrowthWatch.verdict``)."""

    GROWING = "growing"  # kept growing past the jump: the run is diverging
    TURNED = "turned"  # fell back, or fell from their peak: a jump, not a divergence
    UNDECIDED = "undecided"  # neither yet: a plateau, or too few readings after the jump


@dataclass
class GrowthWatch:
    """The trend of the engine's readings after a suspect snapshot (``divergence``), one reading at a time.

    Readings from the last sound snapshot's step on are smoothed (the median of the last ``window``); the *base* is the
    smoothed level right after that snapshot (its own reading where none is left in the history). Once the smoothed
    readings pass ``factor`` x the base, their level then is the *anchor* of the elevated stretch, and they are
    followed to their peak; falling back below the factor ends the stretch. The verdict:

    * ``GROWING``: in an elevated stretch, not turned, every comparable reading (loss, gradient norm) above ``turn`` x
      its anchor and one above ``growth`` x: the run is diverging.
    * ``TURNED``: in a stretch, fallen below 1/``turn`` of its peak in either reading; or no stretch (any more), with
      ``window`` readings seen from the snapshot's step on (the jump was one or two odd batches, or it is over).
    * ``UNDECIDED`` otherwise: a level that holds, or a jump too recent to show in the smoothed readings.

    ``feed`` takes each reading once (the history is re-read only past the last step taken), so following a suspect
    costs a few float operations per batch; a healthy run without a suspect has no watch. Readings of ``since`` and
    earlier are not followed: they belong to a trajectory a rollback abandoned.
    """

    divergence: Divergence
    base: StepHealth
    since: int | None = None
    window: int = CONFIRM_WINDOW
    factor: float = DIVERGED_FACTOR
    growth: float = GROWTH_FACTOR
    turn: float = TURN_FACTOR
    seen: int | None = None  # the last step fed
    after_snapshot: int = 0  # readings fed of the snapshot's step and later
    recent: deque[StepHealth] = field(default_factory=deque)
    smoothed: StepHealth | None = None
    anchor: StepHealth | None = None  # the smoothed level where the current elevated stretch began
    peak: StepHealth | None = None

    @classmethod
    def start(
        cls, divergence: Divergence, history: History, since: int | None = None, window: int = CONFIRM_WINDOW
    ) -> GrowthWatch:
        """Watch ``divergence``'s snapshot, with every reading of ``history`` from the last sound snapshot's step on
        (and after ``since``, the last rollback's step)."""
        start, end = divergence.reference_step, divergence.step
        base = [] if start is None else [StepHealth(float(g), loss) for s, g, loss in history if start <= s < end]
        level = _median(base[:window]) if base else divergence.reference
        watch = cls(divergence, level, since, window, divergence.factor)
        watch.feed(history)
        return watch

    def feed(self, history: History) -> None:
        """Take the readings of ``history`` not taken yet (from the last sound snapshot's step on, after ``since``)."""
        first = self.divergence.reference_step
        for s, g, loss in history:
            if (self.seen is not None and s <= self.seen) or (first is not None and s < first):
                continue
            if self.since is not None and s <= self.since:
                continue
            self.seen = s
            self.after_snapshot += s >= self.divergence.step
            self.recent.append(StepHealth(float(g), loss))
            if len(self.recent) > self.window:
                self.recent.popleft()
            if len(self.recent) < self.window:
                continue
            self.smoothed = now = _median(self.recent)
            if not diverged(now, self.base, self.factor):
                self.anchor = self.peak = None  # not far up (any more): no elevated stretch
            elif self.anchor is None or self.peak is None:
                self.anchor = self.peak = now
            else:
                self.peak = _peak(self.peak, now)

    def verdict(self) -> Trend:
        now, anchor, peak = self.smoothed, self.anchor, self.peak
        if now is None or anchor is None or peak is None:
            return Trend.TURNED if self.after_snapshot >= self.window else Trend.UNDECIDED
        if any(_above(p, v, self.turn) for p, v in ((peak.grad_norm, now.grad_norm), (peak.loss, now.loss))):
            return Trend.TURNED
        return Trend.GROWING if _grew(now, anchor, self.growth, self.turn) else Trend.UNDECIDED


def read_trend(
    divergence: Divergence, history: History, since: int | None = None, window: int = CONFIRM_WINDOW
) -> Trend:
    """The trend after ``divergence``'s snapshot in ``history`` (the engine's ``(step, grad_norm, loss)`` of finite
    steps), from scratch: ``GrowthWatch``'s verdict."""
    return GrowthWatch.start(divergence, history, since, window).verdict()


@dataclass
class SnapshotBook:
    """AutoRollback's record of its snapshots over one fit.

    Each snapshot is judged by the engine's reading of its own step once that reading is in the history (``score``:
    at a later batch's start, since the device path reports a step late). The newest one judged a suspect is watched
    (``GrowthWatch``) at each batch start until the trend decides: growing raises ``diverging`` (the engine handles
    that event at the batch's start), turned makes it sound. A snapshot waits ``quiet_steps`` after an incident that
    distrusts the state (``distrust``).

    Args:
        every_n_steps: the snapshot cadence.
        quiet_steps: no snapshot within this many steps after an incident that distrusts the state.
    """

    every_n_steps: int
    quiet_steps: int
    judge: SnapshotJudge = field(default_factory=SnapshotJudge)
    unscored: list[int] = field(default_factory=list)  # snapshots whose step reading has not reached the history yet
    last_incident: int | None = None  # the last step of an incident that distrusts the state
    diverging: bool = False  # the watched suspect's readings kept growing: not reported to the engine yet
    watch: GrowthWatch | None = None  # the trend after the newest suspect, until it decides
    reported: Divergence | None = None  # the suspect whose readings were last found growing
    rolled_back_at: int | None = None  # the last rollback's step: the readings up to it are an abandoned trajectory

    @property
    def busy(self) -> bool:
        """A batch start has something to read: a snapshot to judge, or a suspect to follow."""
        return bool(self.unscored) or self.watch is not None

    def reset(self) -> None:
        """A new fit: nothing judged, nothing pending."""
        self.judge.reset()
        self.unscored = []
        self.last_incident = None
        self.diverging = False
        self.watch = self.reported = None
        self.rolled_back_at = None

    def due(self, step: int, kept: Collection[int], *, jumped: bool = False) -> bool:
        """A snapshot is due at ``step`` (``kept``: the steps of the snapshots in the ring; ``jumped``: this step's
        learning rate jumped, ``policies.snapshot_rates``)."""
        return snapshot_due(
            step,
            every_n_steps=self.every_n_steps,
            last_snapshot_step=max(kept, default=None),
            last_incident_step=self.last_incident,
            quiet_steps=self.quiet_steps,
            jumped=jumped,
        )

    def keep(self, kept: Collection[int]) -> int | None:
        """The snapshot the ring must not evict for a new one: the newest sound one, while the ones after it are
        suspects."""
        return max((s for s in kept if s not in self.judge.unsound), default=None)

    def taken(self, step: int, kept: Collection[int]) -> None:
        """A snapshot of ``step`` was taken; ``kept``: the ring's steps now (the verdicts of evicted ones go)."""
        self.judge.keep_only(kept)
        self.unscored.append(step)

    def score(self, now: int, history: History, kept: Collection[int]) -> bool:
        """Judge the pending snapshots whose step reading is in ``history`` (host floats the engine keeps anyway), and
        follow the newest suspect's trend with the readings since.

        Returns whether the run is diverging now: the newest snapshot in the ring (``kept``) was judged a suspect and
        the readings after its jump kept growing. The readings are rank-reduced, so every rank returns the same. A
        snapshot with no finite reading of its step is sound: nothing says otherwise.
        """
        pending, self.unscored = self.unscored, []
        newest = history[-1][0] if history else -1
        latest = max(kept, default=None)
        for step in pending:
            found = next((StepHealth(float(g), loss) for s, g, loss in history if s == step), None)
            if found is None and newest <= step and now - step <= self.every_n_steps:
                self.unscored.append(step)  # not read yet (the device path reports a step late)
                continue
            prev = self.judge.previous_step
            quiet = self.last_incident is None or prev is None or self.last_incident < prev
            sound = self.judge.judge(step, found, incident_since_previous=not quiet)
            if sound and self.watch is not None and step > self.watch.divergence.step:
                self._end_watch(vindicated=True)  # a later snapshot is sound: the watched jump is over
            elif not sound and step == latest and self.judge.last_divergence is not None:
                self.watch = GrowthWatch.start(self.judge.last_divergence, history, self.rolled_back_at)
        if self.watch is None:
            return False
        self.watch.feed(history)
        trend = self.watch.verdict()
        if trend is Trend.GROWING:
            self.reported = self.watch.divergence
        if trend is not Trend.UNDECIDED:
            self._end_watch(vindicated=trend is Trend.TURNED)
        return trend is Trend.GROWING

    def _end_watch(self, *, vindicated: bool) -> None:
        if self.watch is not None and vindicated:
            self.judge.vindicate(self.watch.divergence.step)
        self.watch = None

    def settle(self, now: int, history: History, kept: Collection[int]) -> None:
        """Before a restore: judge what is pending; a divergence not yet reported is answered by the restore itself
        (it passes over the snapshot judged a suspect)."""
        self.diverging = False
        if self.busy:
            self.score(now, history, kept)

    def distrust(self, step: int) -> None:
        """An incident at ``step`` distrusts the state: the next snapshot waits ``quiet_steps``."""
        self.last_incident = max(self.last_incident or 0, step)

    def restored(self, step: int, restored_step: int) -> None:
        """At ``step`` the state of ``restored_step`` was restored: later verdicts belong to the abandoned
        trajectory, and the rollback is itself an incident."""
        self.judge.restored(restored_step)
        self.unscored = [s for s in self.unscored if s <= restored_step]
        self.last_incident = self.rolled_back_at = step
        self.watch = None
