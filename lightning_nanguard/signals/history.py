"""Evidence from the run's recent history (host floats the engine already keeps): rising before the step?"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["HistoryFindings", "read_history"]


@dataclass(frozen=True)
class HistoryFindings:
    """Grad norm and loss over the last finite steps, and whether they were rising into the event."""

    steps: tuple[int, ...] = ()
    grad_norms: tuple[float, ...] = ()
    losses: tuple[float | None, ...] = ()
    grad_norm_rising: bool = False
    loss_rising: bool = False

    @property
    def rising(self) -> bool:
        return self.grad_norm_rising or self.loss_rising

    def summary(self) -> str:
        if not self.steps:
            return "no finite step recorded yet"
        norms = ", ".join(f"{g:.3g}" for g in self.grad_norms)
        trend = "rising" if self.grad_norm_rising else "not rising"
        text = f"grad norm over the last {len(self.steps)} finite steps: {norms} ({trend})"
        losses = [v for v in self.losses if v is not None]
        if losses:
            text += f"; loss {', '.join(f'{v:.3g}' for v in losses)} ({'rising' if self.loss_rising else 'not rising'})"
        return text


def _rising(values: list[float], factor: float) -> bool:
    """The last values climb: each of the last three above the one before, and the last ``factor`` x the level they
    climbed from (the median of the values before the last two; not the minimum, which one small early value, a
    first step or a dip, would make a flat history's)."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) < 3:
        return False
    tail = vals[-3:]
    climbing = all(b > a for a, b in itertools.pairwise(tail))
    return climbing and vals[-1] >= factor * max(statistics.median(vals[:-2]), 1e-12)


def read_history(
    history: Iterable[tuple[int, float, float | None]], window: int = 8, factor: float = 3.0
) -> HistoryFindings:
    """The last ``window`` finite steps of ``engine.history`` (``(step, grad_norm, loss)``)."""
    recent = list(history)[-window:]
    norms = [float(g) for _, g, _ in recent]
    losses = [None if v is None else float(v) for _, _, v in recent]
    return HistoryFindings(
        steps=tuple(int(s) for s, _, _ in recent),
        grad_norms=tuple(norms),
        losses=tuple(losses),
        grad_norm_rising=_rising(norms, factor),
        loss_rising=_rising([v for v in losses if v is not None], factor),
    )
