"""Incident records: one JSON object per event, kept in memory and appended to ``incidents.jsonl``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from lightning_nanguard.contract import Action, Cause, Signal

__all__ = ["Incident", "IncidentLog"]

E = TypeVar("E", bound=Enum)


@dataclass(frozen=True)
class Incident:
    """One event: something non-finite (or unhealthy) was seen and an action was taken.

    Attributes:
        step: ``trainer.global_step`` when the event was decided.
        epoch: ``trainer.current_epoch``.
        batch_idx: batch index within the epoch (``-1`` when not tied to a batch).
        ranks: the ranks whose local reading was bad (``[0]`` on one device).
        trigger: what was seen, a ``Signal`` (``nonfinite_grads``, ``loss_scale_collapse``, ...) or, for events
            outside a training step, the code of what was checked (``"nonfinite_checkpoint"``, ``"eps_underflow"``).
        action: the main thing done (``skip``, ``rollback``, ...): the most consequential of ``actions``, so one
            record reads "rollback" when a skip and a rollback were both taken.
        source: the callbacks whose remedies acted, e.g. ``"GradNormMonitor, AutoRollback"``.
        values: the readings behind the decision (finite floats, ``"nan"``/``"inf"`` strings otherwise).
        budget_left: how many more such actions the budget allows (``-1`` when unbounded).
        message: what happened, where, why, what was done and what to try.
        actions: every action taken for this event, in order.
        cause: the diagnosed ``Cause`` (``None`` for events with no diagnosis, written ``""``).
        where: the location the diagnosis names (module, tensors, batch rows, checkpoint).
        diagnosis: the full diagnosis as plain values (``Diagnosis.to_dict()``), ``{}`` when none.
        bundle: the incident bundle's directory (``<log_dir>/nanguard/bundles/step-N``: re-run the step offline with
            ``nanguard replay``), ``""`` when none was written (no replay ran, or it was over its budget).

    The enum fields accept their plain values too (a record read back from ``incidents.jsonl``); a value this version
    does not know (a log written by another version) is kept as its string. ``to_dict`` writes the plain values.
    """

    step: int
    epoch: int
    batch_idx: int
    ranks: list[int]
    trigger: Signal | str
    action: Action
    source: str
    values: dict[str, object] = field(default_factory=dict)
    budget_left: int = -1
    message: str = ""
    actions: list[Action] = field(default_factory=list)
    cause: Cause | None = None
    where: str = ""
    diagnosis: dict[str, object] = field(default_factory=dict)
    bundle: str = ""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen
        set_(self, "trigger", _member(Signal, self.trigger))
        set_(self, "action", _member(Action, self.action))
        set_(self, "actions", [_member(Action, a) for a in self.actions])
        set_(self, "cause", _member(Cause, self.cause) if self.cause else None)

    def to_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch_idx": self.batch_idx,
            "ranks": list(self.ranks),
            "trigger": str(self.trigger),
            "action": str(self.action),
            "source": self.source,
            "values": {k: _json_safe(v) for k, v in self.values.items()},
            "budget_left": self.budget_left,
            "message": self.message,
            "actions": [str(a) for a in self.actions],
            "cause": "" if self.cause is None else str(self.cause),
            "where": self.where,
            "diagnosis": _json_safe(self.diagnosis),
            "bundle": self.bundle,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Incident:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**fields)


class IncidentLog:
    """The incidents of one run, in order. Appends each to ``path`` (JSON lines) when a path is set.

    Only rank 0 is given a path; every rank keeps the same in-memory list because every decision is rank-consistent.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.records: list[Incident] = []

    def add(self, incident: Incident) -> None:
        self.records.append(incident)
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(incident.to_dict(), sort_keys=True) + "\n")
            f.flush()

    def __len__(self) -> int:
        return len(self.records)

    def counts(self) -> dict[str, int]:
        """Number of incidents per main action."""
        out: dict[str, int] = {}
        for r in self.records:
            out[str(r.action)] = out.get(str(r.action), 0) + 1
        return out

    def touch(self) -> None:
        """Create the (empty) file, so a clean run's log exists where the summary says it is."""
        if self.path is not None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8"):
                pass

    @staticmethod
    def read(path: str) -> list[Incident]:
        """Load the incidents a run wrote to ``path`` (lines that are no incident record are left out:
        ``read_checked`` says which)."""
        return IncidentLog.read_checked(path)[0]

    @staticmethod
    def read_checked(path: str) -> tuple[list[Incident], list[str]]:
        """The incidents a run wrote to ``path``, and a note for each line left out: a last line cut short (a run
        killed while appending it: SIGKILL, out of memory, a full disk) or a line that is no incident record."""
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        records: list[Incident] = []
        notes: list[str] = []
        for k, (n, line) in enumerate(lines):
            try:
                data = json.loads(line)
                if not isinstance(data, dict):
                    raise TypeError(f"a JSON {type(data).__name__}, not an object")
                records.append(Incident.from_dict(data))
            except (ValueError, TypeError) as err:
                if k == len(lines) - 1 and not line.endswith("\n"):
                    notes.append(
                        f"{path}:{n}: the last line is cut short (the run was killed while writing it): skipped"
                    )
                else:
                    notes.append(f"{path}:{n}: not an incident record ({str(err)[:80]}): skipped")
        return records, notes


def _member(kind: type[E], value: object) -> object:
    """``value`` as a member of ``kind`` when it is one (or names one); else unchanged."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        return value


def _json_safe(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value
