"""Where a Trainer keeps its engine: on the Trainer itself, so it is freed with it."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_nanguard import _lightning_compat
from lightning_nanguard.engine.engine import Engine

__all__ = ["get_engine"]


class _EngineSlot:
    """Where a Trainer keeps its engine (``Trainer._nanguard_engine``): it lives and dies with the Trainer.

    Not a module-level map from Trainer to engine: the engine refers back to the Trainer through its members
    (CheckpointGuard keeps the Trainer), so even a ``WeakKeyDictionary`` would keep every fitted Trainer, with its
    model, optimizer state and data, alive for the life of the process. Pickled empty: a spawned rank unpickles a
    fresh engine, as it would have built one on first use.
    """

    __slots__ = ("engine",)

    def __init__(self) -> None:
        self.engine = Engine()

    def __reduce__(self) -> tuple[type[_EngineSlot], tuple[()]]:
        return (_EngineSlot, ())


def get_engine(trainer: pl.Trainer) -> Engine:
    """The nanguard engine of ``trainer`` (created on first use, kept on the Trainer, dropped with it)."""
    slot = _lightning_compat.instance_attribute(trainer, "_nanguard_engine")
    if slot is None:
        slot = _EngineSlot()
        _lightning_compat.set_instance_attribute(trainer, "_nanguard_engine", slot)
    return slot.engine
