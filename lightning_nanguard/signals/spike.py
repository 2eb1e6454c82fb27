"""A running z-score on host floats: is this step's value a spike against the recent ones?

The step's gradient norm and loss reach the host with the step's one read anyway, so the test costs a few float
operations and no tensor op. Values are compared in log space, so the test is scale-free (a 10x jump is the same
spike at loss 3.0 or 0.003) and a loss or gradient norm that drifts down over training does not look like a spike.
Statistics are an exponential moving mean and variance, updated only with finite, non-spiking values, so a spike does
not teach the detector that spikes are normal. A level that holds is not a spike, though: after ``NEW_LEVEL_AFTER``
spikes in a row (a new data domain, a curriculum stage: the loss stays up whether or not the updates are dropped) the
statistics start again at that level, so a run whose data changed is not flagged, and its updates dropped, forever.
Whether a rise keeps growing (a divergence) is judged elsewhere (``policies.snapshot_health``).
"""

from __future__ import annotations

import math
import statistics

__all__ = ["NEW_LEVEL_AFTER", "RunningZScore"]

_MIN_STD = 0.05  # log-space floor: below ~5% relative noise, a z-score would flag ordinary jitter
# Spikes in a row after which their level is the new normal: rare hard batches come one or two at a time.
NEW_LEVEL_AFTER = 5


class RunningZScore:
    """Flags values more than ``threshold`` standard deviations above the running mean of their logarithm.

    Args:
        threshold: z-score above which a value is a spike.
        warmup: values observed before any is tested.
        beta: EMA decay of the mean and variance (``0.98``: about the last 50 values).
    """

    def __init__(self, threshold: float, warmup: int, beta: float = 0.98) -> None:
        self.threshold, self.warmup, self.beta = float(threshold), int(warmup), float(beta)
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self.last_z = 0.0
        self._streak: list[float] = []  # the logs of the spikes in a row so far

    def observe(self, value: float) -> bool:
        """Test ``value`` (positive) and fold it into the statistics unless it spiked (or, the ``NEW_LEVEL_AFTER``-th
        spike in a row, start the statistics again at their level)."""
        if not math.isfinite(value):
            self.last_z = 0.0
            return False
        x = math.log(max(abs(value), 1e-30))
        std = max(math.sqrt(self.var), _MIN_STD)
        z = (x - self.mean) / std
        self.last_z = z
        if self.count >= self.warmup and z > self.threshold:
            self._streak.append(x)
            if len(self._streak) < NEW_LEVEL_AFTER:
                return True
            self.mean = statistics.fmean(self._streak)
            self.var = max(self.var, statistics.pvariance(self._streak))
            self._streak.clear()
            self.count += 1
            return False
        self._streak.clear()
        if self.count == 0:
            self.mean, self.var = x, 0.0
        else:
            delta = x - self.mean
            self.mean += (1 - self.beta) * delta
            self.var = self.beta * (self.var + (1 - self.beta) * delta * delta)
        self.count += 1
        return False

    def state(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": float(self.count)}

    def load(self, state: dict[str, float]) -> None:
        self.mean = float(state.get("mean", 0.0))
        self.var = float(state.get("var", 0.0))
        self.count = int(state.get("count", 0))
