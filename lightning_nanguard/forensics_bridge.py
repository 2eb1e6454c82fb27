"""Where the engine asks forensics for a diagnosis (``None``: the cheap evidence decides, in ``engine.diagnose``)."""

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
    """The forensics verdict on one event (every rank calls this, with rank-consistent ``facts``).

    ``GradNormMonitor(forensics="off")`` still gets the cheap evidence (``forensics`` says so in the note);
    ``"first"`` replays once per evidence signature and reuses that replay (``engine.diagnoses``); ``"every"``
    replays each event that the cheap evidence does not settle.
    """
    from lightning_nanguard.forensics import investigate as run

    return run(engine, trainer, pl_module, facts)
