"""One event on the incident path, as the one object every stage takes (diagnose, the bundle, the blame's test,
decide, act): the Trainer and the module, the event's facts, what is installed, the fit's record, the bus and the run
directory."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl

from lightning_nanguard.engine.accounting import FitLedger
from lightning_nanguard.engine.bus import EventBus
from lightning_nanguard.engine.events import EventFacts
from lightning_nanguard.engine.registry import Registry

__all__ = ["IncidentContext"]


@dataclass(frozen=True)
class IncidentContext:
    """What every stage of one event's handling reads (``incidents.IncidentPath``)."""

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    facts: EventFacts
    registry: Registry
    ledger: FitLedger
    bus: EventBus
    run_dir: str | None  # where the incident bundle goes (the same on every rank); None: no logger
