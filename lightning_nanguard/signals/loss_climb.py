"""A loss that climbs and stays up: the first sign of a divergence that does not spike the gradient. Pure.

A divergence need not spike the gradient norm: a softmax that saturates (attention logits grown past the stability
edge) shrinks it, and a loss that climbs over a few steps from a level it had itself come down to is no outlier to a
running z-score. What it does is give back what the run had learned, and keep it given back. ``LossProgress`` measures
that on the host floats the step's one read brings back anyway (no tensor op, no host read): the median of the last
``CLIMB_SPAN`` losses (three steps of five must be up: one hard batch is not a climb), against the lowest such median
of the last ``CLIMB_WINDOW`` steps (where the run had come to lately) and the median of the fit's first ``CLIMB_SPAN``
losses (where it started). ``lost()`` is the share of that progress given back: 0 at the recent low, 1 back at the
start. A run that has not come down by ``LEARNED`` of its starting loss has no progress to lose (``None``).

``ClimbingLoss`` is the spike detector's loss test with a climb beside it: a median that gave back ``CLIMB_LOST`` of
the progress flags, and flags again every ``CLIMB_AGAIN`` steps while it stays there (a divergence that the probe's
few rows do not show yet shows a few steps on; a new level the run settles at stops flagging once the recent low has
left the window, after at most ``CLIMB_WINDOW / CLIMB_AGAIN`` probes). A climb is probed like a spike
(``on_spike="probe"`` only): the probe batch decides whether the weights got worse or the data or the objective
changed (a new domain, a curriculum stage: the probe's like-with-like scoring sees the same change in both).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from lightning_nanguard.signals.spike import RunningZScore

__all__ = [
    "CLIMB_AGAIN",
    "CLIMB_LOST",
    "CLIMB_SPAN",
    "CLIMB_WINDOW",
    "LEARNED",
    "ClimbingLoss",
    "LossProgress",
    "LossTrend",
    "given_back",
    "load_spikes_state",
    "spikes_state",
]

CLIMB_SPAN = 5  # losses in one median: three steps of five must be up
CLIMB_WINDOW = 50  # steps the recent low is taken over (the preset's snapshot cadence)
CLIMB_LOST = 0.5  # the share of the recent progress a climb gives back: half of what the run had learned
CLIMB_AGAIN = 10  # steps between the flags of a climb that stays up
LEARNED = 0.25  # the least share of its starting loss a run must have come down by to have progress to lose


def given_back(now: float, low: float, start: float) -> float | None:
    """The share of the progress from ``start`` down to ``low`` that ``now`` gave back: 0 at ``low``, 1 back at
    ``start`` (infinite for a non-finite ``now``). ``None`` where ``low`` is not ``LEARNED`` of ``start`` below it:
    no progress to lose."""
    learned = start - low
    if not (learned > 0 and learned >= LEARNED * abs(start)):
        return None
    return (now - low) / learned if math.isfinite(now) else math.inf


@dataclass(frozen=True)
class LossTrend:
    """What the training loss says at a probed step.

    Attributes:
        lost: the share of its recent progress the loss gave back (``LossProgress.lost``; ``None``: not known).
        level: the loss's level now (``LossProgress.level``: a median of five steps; ``None``: not known).
        climb_only: the step was probed for a climb alone (no z-score spike of the loss or the gradient norm).
    """

    lost: float | None = None
    level: float | None = None
    climb_only: bool = False


class LossProgress:
    """Where the loss started, where it came to lately, and where it is now (medians of ``CLIMB_SPAN`` steps)."""

    def __init__(self) -> None:
        self.start: float | None = None  # the median of the fit's first CLIMB_SPAN losses
        self._first: list[float] = []
        self._last: deque[float] = deque(maxlen=CLIMB_SPAN)
        self._medians: deque[float] = deque(maxlen=CLIMB_WINDOW)

    def observe(self, value: float) -> None:
        """A finite step's loss."""
        if not math.isfinite(value):
            return
        if self.start is None:
            self._first.append(value)
            if len(self._first) == CLIMB_SPAN:
                self.start = statistics.median(self._first)
        self._last.append(value)
        if len(self._last) == CLIMB_SPAN:
            self._medians.append(statistics.median(self._last))

    def restart(self) -> None:
        """An older state was restored: the abandoned trajectory's levels are forgotten (its start is not)."""
        self._last.clear()
        self._medians.clear()

    def state_dict(self) -> dict[str, list[float]]:
        """What a checkpoint keeps, so that a resumed fit measures its progress as the uninterrupted one does."""
        return {
            "start": [] if self.start is None else [self.start],
            "first": list(self._first),
            "last": list(self._last),
            "medians": list(self._medians),
        }

    def load_state_dict(self, state: object) -> None:
        """A ``state_dict()`` from a checkpoint (``ValueError``: not one)."""
        if not isinstance(state, dict):
            raise ValueError(f"the loss's progress is a {type(state).__name__}, not a dict")
        lists = {}
        for key in ("start", "first", "last", "medians"):
            values = state.get(key, [])
            if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
            ):
                raise ValueError(f"the loss's progress has a malformed {key!r}: {values!r:.80}")
            lists[key] = [float(v) for v in values]
        if len(lists["start"]) > 1:
            raise ValueError(f"the loss's progress has {len(lists['start'])} starts")
        self.start = lists["start"][0] if lists["start"] else None
        self._first = lists["first"][:CLIMB_SPAN]
        self._last = deque(lists["last"], maxlen=CLIMB_SPAN)
        self._medians = deque(lists["medians"], maxlen=CLIMB_WINDOW)

    @property
    def level(self) -> float | None:
        """The median of the last ``CLIMB_SPAN`` losses (``None``: fewer seen since the start or a restore)."""
        return self._medians[-1] if self._medians else None

    def lost(self) -> float | None:
        """The share of the recent progress given back now (``None``: no progress to lose, or too few steps)."""
        if self.start is None or not self._medians:
            return None
        return given_back(self._medians[-1], min(self._medians), self.start)


class ClimbingLoss(RunningZScore):
    """The loss's running z-score (``RunningZScore``) that also flags a climb (the module docstring).

    Args:
        threshold: z-score above which a value is a spike.
        warmup: values observed before any is tested (for a climb too).
        beta: EMA decay of the z-score's mean and variance.
    """

    def __init__(self, threshold: float, warmup: int, beta: float = 0.98) -> None:
        super().__init__(threshold, warmup, beta)
        self.progress = LossProgress()
        self._since: int | None = None  # steps since the climb was last flagged (``None``: not climbing)
        self.climbed = False  # the last ``observe`` flagged a climb that was no z-score spike

    def restart(self) -> None:
        """An older state was restored: its losses are measured from its own level."""
        self.progress.restart()
        self._since = None

    def observe(self, value: float) -> bool:
        spike = super().observe(value)
        self.climbed = False
        if not math.isfinite(value):
            return spike
        self.progress.observe(value)
        lost = self.progress.lost()
        if lost is None or lost < CLIMB_LOST or self.count <= self.warmup:
            self._since = None
            return spike
        due = self._since is None or self._since >= CLIMB_AGAIN
        self._since = 1 if due else (self._since or 0) + 1
        self.climbed = due and not spike
        return spike or due


def spikes_state(spikes: tuple[RunningZScore, RunningZScore]) -> dict[str, object]:
    """What a checkpoint keeps of the spike detectors (the gradient norm's, the loss's): their statistics, and the
    loss's progress where it watches for a climb."""
    grad, loss = spikes
    state: dict[str, object] = {"grad": grad.state(), "loss": loss.state()}
    if isinstance(loss, ClimbingLoss):
        state["climb"] = loss.progress.state_dict()
    return state


def load_spikes_state(spikes: tuple[RunningZScore, RunningZScore], state: dict[str, object]) -> None:
    """A ``spikes_state()`` from a checkpoint into this fit's detectors (``ValueError``, ``TypeError``: malformed)."""
    grad, loss = spikes
    for detector, key in ((grad, "grad"), (loss, "loss")):
        saved = state.get(key, {})
        if not isinstance(saved, dict):
            raise ValueError(f"the {key} spike statistics are a {type(saved).__name__}, not a dict")
        detector.load(saved)
    climb = state.get("climb")
    if climb is not None and isinstance(loss, ClimbingLoss):
        loss.progress.load_state_dict(climb)
