"""The loss scale's recent history: the scale each step ran with, kept where it changed (a collapse's record)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["ScaleHistory"]


class ScaleHistory:
    """The last ``size`` changes of the loss scale, as ``(step, scale)``, oldest first; and the last scale seen."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.changes: deque[tuple[int, float]] = deque(maxlen=size)
        self.last: float | None = None

    def note(self, step: int, scale: float) -> None:
        """The scale ``step`` ran with: kept when it changed."""
        self.last = scale
        if not self.changes or self.changes[-1][1] != scale:
            self.changes.append((step, scale))

    def as_lists(self) -> list[list[float]]:
        """``[[step, scale], ...]``: plain values for a record or a checkpoint."""
        return [[s, v] for s, v in self.changes]

    def load(self, pairs: Iterable[Iterable[float]]) -> None:
        self.changes = deque(((int(s), float(v)) for s, v in pairs), maxlen=self.size)
