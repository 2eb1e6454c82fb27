"""A loss that climbs and stays up: the first sign of a divergence that does not spike the gradient.

A divergence need not spike the gradient norm: a softmax that saturates (attention logits grown past the stability
edge) shrinks it, and a loss that rises over a few steps from a level that was itself falling fast is no outlier to a
running z-score. What it does is climb and stay up. ``ClimbingLoss`` is the spike detector's loss test with that
second test beside it, on the same host float the step's one read brings back anyway (no tensor op, no host read):
the median of the last ``CLIMB_SPAN`` losses above ``CLIMB_FACTOR`` x the median of such medians over the last
``CLIMB_WINDOW`` steps (the run's typical recent level). A median of five is up only when three of the five steps are: one hard batch is not a climb.
It fires once per climb (again only after the median has come back down under the line, or the line has risen to
the new level: a new data domain's level is probed once, not again and again while the model forgets the old one). A climb is probed like a spike (``on_spike="probe"`` only): the probe batch decides whether the
weights got worse or the data or the objective changed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["CLIMB_FACTOR", "CLIMB_SPAN", "CLIMB_WINDOW", "ClimbingLoss"]

CLIMB_FACTOR = 2.0  # a level this far above the recent one: a 5-step median of ordinary batches wobbles by ~20%
CLIMB_SPAN = 5  # losses in one median: three steps of five must be up
CLIMB_WINDOW = 50  # steps the recent level is taken over (the preset's snapshot cadence)


class ClimbingLoss(RunningZScore):
    """The loss's running z-score (``RunningZScore``) that also flags a climb (the module docstring).

    Args:
        threshold: z-score above which a value is a spike.
        warmup: values observed before any is tested (for a climb too).
        beta: EMA decay of the z-score's mean and variance.
    """

    def __init__(self, threshold: float, warmup: int, beta: float = 0.98) -> None:
        super().__init__(threshold, warmup, beta)
        self._last: deque[float] = deque(maxlen=CLIMB_SPAN)
        self._medians: deque[float] = deque(maxlen=CLIMB_WINDOW)
        self._climbing = False  # the median is up (fired already)
        self.seen = 0
        self.climbed = False  # the last ``observe`` flagged a climb (not a z-score spike)

    def restart(self) -> None:
        """A rollback restored an older state: its losses are no climb over the abandoned trajectory's level."""
        self._last.clear()
        self._medians.clear()
        self._climbing = False

    def observe(self, value: float) -> bool:
        spike = super().observe(value)
        self.climbed = False
        if not math.isfinite(value):
            return spike
        self.seen += 1
        self._last.append(value)
        if len(self._last) < CLIMB_SPAN:
            return spike
        median = statistics.median(self._last)
        level = statistics.median(self._medians) if self._medians else median
        self._medians.append(median)
        up = median > CLIMB_FACTOR * level
        fired = up and not self._climbing and self.seen > self.warmup
        self._climbing = up
        self.climbed = fired and not spike
        return spike or fired
