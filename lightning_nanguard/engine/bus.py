"""Typed events between nanguard's parts: subscribe by event class, emit a frozen dataclass.

Only events the engine decided (identical on every rank) are emitted here, so a subscriber may change state that
drives a decision or a collective. Rank-local facts (a checkpoint refused on rank 0, which alone saves) are reported
to the incident sink, never emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import lightning.pytorch as pl

__all__ = ["EventBus"]

E = TypeVar("E")


class EventBus:
    """``subscribe(StateRestored, fn)``; ``emit(trainer, StateRestored(...))`` calls ``fn(trainer, event)``."""

    def __init__(self) -> None:
        self._listeners: dict[type, list[Callable[[pl.Trainer, Any], None]]] = {}

    def subscribe(self, event_type: type[E], fn: Callable[[pl.Trainer, E], None]) -> None:
        fns = self._listeners.setdefault(event_type, [])
        if fn not in fns:
            fns.append(fn)

    def emit(self, trainer: pl.Trainer, event: object) -> None:
        for fn in list(self._listeners.get(type(event), [])):
            fn(trainer, event)

    def clear(self) -> None:
        self._listeners.clear()
