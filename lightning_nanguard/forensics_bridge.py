"""Where the engine asks forensics for a replay-based diagnosis (``None``: the cheap evidence decides)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl

from lightning_nanguard.contract import Diagnosis

if TYPE_CHECKING:
    from lightning_nanguard.engine.diagnose import EventFacts
    from lightning_nanguard.engine.engine import Engine

__all__ = ["investigate"]


def investigate(
    engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, facts: EventFacts
) -> Diagnosis | None:
    del engine, trainer, pl_module, facts
    return None
