"""The rules of a data blame's test, as pure functions of the diagnosis and the findings (the replay that tests it:
``engine/counterfactual.py``; the chains a quarantine that did not stop the fault withdraws: ``withdrawal``)."""

from __future__ import annotations

import dataclasses

from lightning_nanguard.contract import Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.policies.diagnosis import classify, strip_rows
from lightning_nanguard.policies.findings import Findings

__all__ = ["MEASURED", "is_measured", "redecide", "untested"]

# Evidence that the blamed records themselves hold NaN/inf: measured, quarantined even where no replay can test it.
MEASURED = (EvidenceKind.BATCH_NONFINITE, EvidenceKind.TARGETS_NONFINITE)


def is_measured(d: Diagnosis) -> bool:
    """The blamed records hold NaN/inf themselves: a measurement, not a hypothesis."""
    return any(e.kind in MEASURED for e in d.evidence) or (d.origin or {}).get("phase") == "input"


def untested(d: Diagnosis, why: str) -> Diagnosis:
    """No replay can test the blame: only records that hold NaN/inf themselves (measured) are quarantined."""
    measured = is_measured(d)
    record = {"rows": list(d.rows), "tested": False, "why": why, "quarantine": measured}
    if measured:
        note = f"the blamed records hold NaN/inf themselves; no replay could test the blame ({why})"
    else:
        note = f"the data blame could not be tested ({why}): nothing quarantined"
    return dataclasses.replace(d, counterfactual=record, note="; ".join(x for x in (d.note, note) if x))


def redecide(f: Findings, d: Diagnosis, ev: Evidence, record: dict[str, object]) -> Diagnosis:
    """The records were not the cause: decide again without them (a formula keeps its cause, untriggered)."""
    again = classify(strip_rows(f))
    note = f"the data blame ({d.cause.value} at {d.where}) was withdrawn: nothing quarantined"
    return dataclasses.replace(
        again,
        evidence=(*again.evidence, ev),
        counterfactual=record,
        caused_by_data=False,
        rows=(),
        rank_rows=(),
        note="; ".join(x for x in (again.note, note) if x),
    )
