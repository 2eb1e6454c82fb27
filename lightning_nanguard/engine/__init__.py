"""The per-Trainer engine: sense, diagnose, decide, act, report (see ARCHITECTURE.md)."""

from lightning_nanguard.engine.engine import Engine
from lightning_nanguard.engine.slot import get_engine

__all__ = ["Engine", "get_engine"]
