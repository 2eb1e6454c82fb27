"""A remedy that does not work withdraws its hypothesis: a quarantine that did not stop the fault releases its records.

Records blamed as a hypothesis (valid records that trigger a formula bug, records that only look wrong: outsized,
labels past the head), not records that hold NaN/inf themselves (a measurement), form a *chain* per cause and place
(the origin's op and line, else the kind of evidence). After the chain quarantined something, either of these says
the data was not the cause:

* an incident of the same cause at the same place within ``WINDOW`` steps: fresh records (the quarantined ones are
  left out) meet the same fault, so the model's state or formula is what fails;
* the records the hypotheses quarantined pass ``max_quarantined_fraction`` of the dataset (never fewer than
  ``MIN_RECORDS``): a fault that many records "trigger" is not theirs.

The chain is then withdrawn: its records are released (the quarantine file is rewritten), it quarantines nothing more,
and the cause is decided again from the other evidence (a formula keeps its cause, untriggered; a data cause is
decided without the rows). The incident says so (its ``withdrawn`` evidence and note), and so does the end-of-fit
summary. Rank-consistent: every value here comes from the diagnosis and the quarantine, identical on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lightning_nanguard.contract import Action, Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.engine.counterfactual import MEASURED, redecide
from lightning_nanguard.policies.findings import Findings
from lightning_nanguard.recovery.quarantine import Quarantine

__all__ = ["MIN_RECORDS", "WINDOW", "Blames", "Chain", "hypothesis", "place"]

WINDOW = 200  # steps: the same fault from fresh records this soon after a quarantine withdraws its blame
MIN_RECORDS = 4  # the quarantined share is judged past this many records (0.5% of a tiny dataset is under one)


def _measured(d: Diagnosis) -> bool:
    """The blamed records hold NaN/inf themselves: a measurement, not a hypothesis."""
    return any(e.kind in MEASURED for e in d.evidence) or (d.origin or {}).get("phase") == "input"


def hypothesis(d: Diagnosis) -> bool:
    """``d`` blames records that do not hold NaN/inf themselves: a hypothesis a remedy can refute."""
    return d.caused_by_data and not d.state_damaged and not _measured(d)


def place(d: Diagnosis) -> tuple[str, str]:
    """The chain a blame belongs to: its cause and the origin's op and line (else its first evidence's kind)."""
    o = d.origin or {}
    frame = o.get("frame") if isinstance(o.get("frame"), dict) else None
    if o.get("op"):
        line = f"{frame.get('file')}:{frame.get('line')}" if isinstance(frame, dict) else ""
        return d.cause.value, f"{o.get('op')} at {line}"
    return d.cause.value, d.evidence[0].kind.value if d.evidence else ""


@dataclass
class Chain:
    """The quarantines of one cause at one place."""

    steps: list[int] = field(default_factory=list)
    samples: list[tuple[str, int]] = field(default_factory=list)
    prints: list[str] = field(default_factory=list)
    withdrawn: int | None = None  # the step it was withdrawn at
    release_due: bool = False


class Blames:
    """The fit's data hypotheses (``FitLedger.blames``)."""

    def __init__(self) -> None:
        self.chains: dict[tuple[str, str], Chain] = {}
        self.lines: list[str] = []  # for the end-of-fit summary

    def judge(self, findings: Findings, d: Diagnosis, step: int) -> Diagnosis:
        """``d``, withdrawn where its chain's quarantine did not stop the fault (before any new quarantine). The
        same cause at the same place counts as a recurrence whether or not this incident names its rows (a kept
        replay reused without them): the quarantined records are left out, so whatever met it is fresh."""
        if d.state_damaged or _measured(d):
            return d
        chain = self.chains.get(place(d))
        if chain is None or not chain.steps:
            return d
        if chain.withdrawn is not None:
            if not d.caused_by_data:
                return d
            ev = Evidence(
                EvidenceKind.WITHDRAWN,
                f"the data blame for {d.cause.value} at this place was withdrawn at step {chain.withdrawn}",
            )
            return redecide(findings, d, ev, {"quarantine": False, "withdrawn": chain.withdrawn})
        if step - chain.steps[-1] > WINDOW:
            return d
        chain.withdrawn, chain.release_due = step, True
        count = len(chain.samples) + len(chain.prints)
        line = (
            f"step {step}: the quarantine of {count} record(s) for {d.cause.value} (steps {chain.steps}) did not stop "
            "it: fresh records met the same fault at the same place, so the data was not the cause; released them"
        )
        self.lines.append(line)
        ev = Evidence(EvidenceKind.WITHDRAWN, line, {"steps": list(chain.steps), "released": count})
        record: dict[str, object] = {"quarantine": False, "withdrawn": step, "released": count}
        if not d.caused_by_data:
            note = "; ".join(x for x in (d.note, line) if x)
            return dataclasses.replace(d, evidence=(*d.evidence, ev), counterfactual=record, note=note)
        return redecide(findings, d, ev, record)

    def settle(
        self, quarantine: Quarantine | None, d: Diagnosis, step: int, details: dict[Action, str], fraction: float
    ) -> None:
        """After the actions: release what a withdrawn chain held; add this incident's quarantine to its chain, and
        withdraw the chain whose records pass the quarantined-share budget."""
        if quarantine is None:
            return
        for chain in self.chains.values():
            if chain.release_due:
                chain.release_due = False
                quarantine.release(chain.samples, chain.prints, step)
        if Action.QUARANTINE not in details or not hypothesis(d):
            return
        samples, prints = quarantine.last_added
        quarantine.last_added = ([], [])
        if not (samples or prints):
            return
        chain = self.chains.setdefault(place(d), Chain())
        chain.steps.append(step)
        chain.samples.extend(samples)
        chain.prints.extend(prints)
        size = quarantine.dataset_size()
        held = sum(len(c.samples) for c in self.chains.values() if c.withdrawn is None)
        if not size or held <= max(MIN_RECORDS, math.floor(fraction * size)):
            return
        released = quarantine.release(chain.samples, chain.prints, step)
        chain.withdrawn = step
        line = (
            f"step {step}: records blamed as a hypothesis are {held} of {size} samples, past "
            f"max_quarantined_fraction={fraction:g}: a fault that many records trigger is not theirs; released the "
            f"{released} record(s) quarantined for {d.cause.value}"
        )
        self.lines.append(line)
        details[Action.QUARANTINE] += f"; then {line.split(': ', 1)[1]}"
