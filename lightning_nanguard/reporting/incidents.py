"""Incident records: one JSON object per event, kept in memory and appended to ``incidents.jsonl``.

**Recurring incidents are one record with a count.** An incident that only dropped an update (``skip``,
``scaler_skip``, ``quarantine``, ``warn``: nothing restored, backed off, promoted or stopped) and has the same
trigger, cause, place (the module the diagnosis named, else the op and line of the first non-finite value its origin
named for a formula, whatever the rows, else its ``where``) and actions as an earlier one of the run is a *repeat*:
the earlier record counts it (``repeats``, ``last_step``) and the log gets one short line, ``{"repeat_of": <the
record's step>, "step": ..., "repeats": ..., "trigger": ..., "cause": ..., "where": ...}``, which ``IncidentLog.read``
folds back into its record. The log stays one line per event, in order, and parseable at any point (a run killed
mid-way leaves the counts up to its last line); the summary and ``nanguard report`` show one line
for the recurring fault, "N times between steps a and b".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, TypeVar

from lightning_nanguard.contract import Action, Cause, Notice, Signal

__all__ = ["INCIDENTS_FILE", "Incident", "IncidentLog"]

INCIDENTS_FILE = os.path.join("nanguard", "incidents.jsonl")  # in the run's log directory (rank 0 writes it)

E = TypeVar("E", bound=Enum)


@dataclass(frozen=True)
class Incident:
    """One event: something non-finite (or unhealthy) was seen and an action was taken.

    Attributes:
        step: ``trainer.global_step`` when the event was decided.
        epoch: ``trainer.current_epoch``.
        batch_idx: batch index within the epoch (``-1`` when not tied to a batch).
        ranks: the ranks whose local reading was bad (``[0]`` on one device).
        trigger: what was seen, a ``Signal`` (``nonfinite_grads``, ``loss_scale_collapse``, ...) or, for what was seen
            outside a training step, a ``Notice`` (``nonfinite_checkpoint``, ``eps_underflow``); a plain string only
            in a record read back from a file that names neither.
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
        repeats: how many more times the same incident happened later in the run (see the module docstring).
        last_step: the step of the last repeat (``-1`` while there is none).
        bundle: the incident bundle's directory (``<log_dir>/nanguard/bundles/step-N``: re-run the step offline with
            ``nanguard replay``), ``""`` when none was written (no replay ran, or it was over its budget).

    The enum fields accept their plain values too (a record read back from ``incidents.jsonl``); a value this version
    does not know (a log written by another version) is kept as its string. ``to_dict`` writes the plain values.
    """

    step: int
    epoch: int
    batch_idx: int
    ranks: list[int]
    trigger: Signal | Notice | str
    action: Action
    source: str
    values: dict[str, object] = field(default_factory=dict)
    budget_left: int = -1
    message: str = ""
    actions: list[Action] = field(default_factory=list)
    cause: Cause | None = None
    where: str = ""
    diagnosis: dict[str, object] = field(default_factory=dict)
    repeats: int = 0
    last_step: int = -1
    bundle: str = ""

    @property
    def count(self) -> int:
        """How many times this incident happened (the first time and its repeats)."""
        return 1 + self.repeats

    @property
    def recurring_key(self) -> tuple[str, ...] | None:
        """What a repeat of this incident has in common with it: trigger, cause, place, actions; ``None`` for an
        incident that is never aggregated (it changed the state or the run, or was seen outside a step)."""
        actions = [str(a) for a in (self.actions or [self.action])]
        if not actions or not set(actions) <= _DROP_ONLY:
            return None
        place = self.diagnosis.get("module") or _origin_place(self.diagnosis.get("origin")) or self.where
        return (str(self.trigger), str(self.cause or ""), str(place), *actions)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen
        set_(self, "trigger", _member(Notice, _member(Signal, self.trigger)))
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
            **({"repeats": self.repeats, "last_step": self.last_step} if self.repeats else {}),
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
        self._recurring: dict[tuple[str, ...], int] = {}  # recurring_key -> index of its record

    def add(self, incident: Incident) -> Incident | None:
        """Record ``incident``. A repeat of an earlier incident (``Incident.recurring_key``) updates that record's
        count instead, and the record is returned; ``None`` for a new record."""
        key = incident.recurring_key
        at = self._recurring.get(key) if key is not None else None
        if at is not None:
            first = self.records[at]
            record = replace(first, repeats=first.repeats + 1, last_step=incident.step)
            self.records[at] = record
            self._append(_repeat_line(record))
            return record
        if key is not None:
            self._recurring[key] = len(self.records)
        self.records.append(incident)
        self._append(incident.to_dict())
        return None

    def _append(self, data: dict[str, object]) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(data, sort_keys=True) + "\n")
            f.flush()

    def __len__(self) -> int:
        return len(self.records)

    def counts(self) -> dict[str, int]:
        """Number of incidents per main action (repeats included)."""
        out: dict[str, int] = {}
        for r in self.records:
            out[str(r.action)] = out.get(str(r.action), 0) + r.count
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
                if "repeat_of" in data:
                    _check_types(data, _REPEAT_FIELDS, required=("repeat_of", "step"))
                    if not _fold_repeat(records, data):
                        notes.append(f"{path}:{n}: a repeat of an incident not in the log: skipped")
                    continue
                _check_types(data, _FIELDS, required=_REQUIRED)
                records.append(Incident.from_dict(data))
            except (ValueError, TypeError, KeyError, RecursionError) as err:
                if k == len(lines) - 1 and not line.endswith("\n"):
                    notes.append(
                        f"{path}:{n}: the last line is cut short (the run was killed while writing it): skipped"
                    )
                else:
                    notes.append(f"{path}:{n}: not an incident record ({str(err)[:80]}): skipped")
        return records, notes


# The actions of an incident that only dropped an update: its repeats are counted in its record.
def _origin_place(origin: object) -> str:
    """``"aten.log.default at model.py:45"``: where a formula failed, the same whichever rows met it; ``""`` if none,
    or if the origin is bad data (each batch's bad rows are a place of their own)."""
    frame = origin.get("frame") if isinstance(origin, Mapping) else None
    if not isinstance(origin, Mapping) or origin.get("data_at_fault") or not isinstance(frame, Mapping):
        return ""
    if not frame.get("file"):  # no line to name
        return ""
    return f"{origin.get('op', '')} at {frame.get('file')}:{frame.get('line')}"


_DROP_ONLY = {str(Action.SKIP), str(Action.SCALER_SKIP), str(Action.QUARANTINE), str(Action.WARN)}


def _repeat_line(record: Incident) -> dict[str, object]:
    return {
        "repeat_of": record.step,
        "step": record.last_step,
        "repeats": record.repeats,
        "trigger": str(record.trigger),
        "cause": "" if record.cause is None else str(record.cause),
        "where": record.where,
    }


# The JSON types of a record's fields (``Incident.to_dict``), checked when a log is read back: a line that is no
# record a run wrote is left out with a note, never shown half-read.
_INT, _STR = (int,), (str,)
_FIELDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("step", "epoch", "batch_idx", "budget_left", "repeats", "last_step"), _INT),
    **dict.fromkeys(("trigger", "action", "source", "message", "where", "bundle"), _STR),
    "cause": (str, type(None)),
    "ranks": (list,),
    "actions": (list,),
    "values": (dict,),
    "diagnosis": (dict,),
}
_REQUIRED = ("step", "epoch", "batch_idx", "ranks", "trigger", "action", "source")
_REPEAT_FIELDS: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("repeat_of", "step", "repeats"), _INT),
    **dict.fromkeys(("trigger", "where"), _STR),
    "cause": (str, type(None)),
}


def _check_types(data: Mapping[str, Any], fields: Mapping[str, tuple[type, ...]], required: tuple[str, ...]) -> None:
    """``TypeError`` naming the first field that is missing or of another JSON type than a run writes."""
    for name in required:
        if name not in data:
            raise KeyError(f"no {name!r}")
    for name, kinds in fields.items():
        value = data.get(name)
        if name in data and (not isinstance(value, kinds) or (isinstance(value, bool) and kinds == _INT)):
            raise TypeError(f"{name!r} is a JSON {type(value).__name__}")
    for name, kind in (("ranks", int), ("actions", str)):
        if not all(isinstance(v, kind) and not isinstance(v, bool) for v in data.get(name, [])):
            raise TypeError(f"{name!r} holds a value that is not a JSON {kind.__name__}")


def _fold_repeat(records: list[Incident], data: Mapping[str, Any]) -> bool:
    """Count a repeat line into its record (the newest one of that step, trigger, cause and place)."""
    for i in range(len(records) - 1, -1, -1):
        r = records[i]
        same = (r.step, str(r.trigger), "" if r.cause is None else str(r.cause), r.where)
        if same == (data.get("repeat_of"), data.get("trigger"), data.get("cause"), data.get("where")):
            records[i] = replace(r, repeats=int(data.get("repeats", r.repeats + 1)), last_step=int(data["step"]))
            return True
    return False


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
