"""Metric keys, emission to the Trainer's loggers, incident records and the end-of-fit summary."""

from lightning_nanguard.reporting.incidents import Incident, IncidentLog
from lightning_nanguard.reporting.keys import PREFIX, key

__all__ = ["PREFIX", "Incident", "IncidentLog", "key"]
