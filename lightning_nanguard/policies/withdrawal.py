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

The chains travel in the checkpoint with the quarantine they justify (``Blames.state_dict``, saved by
GradNormMonitor, the quarantine's owner, under ``"blames"``; ``STATE_VERSION``): a resumed run withdraws a blame made
before the resume as the uninterrupted run does. ``load_state_dict`` validates every field and raises ``ValueError``
saying which is malformed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.contract import Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.exceptions import brief
from lightning_nanguard.policies.counterfactual import is_measured, redecide
from lightning_nanguard.policies.findings import Findings

__all__ = ["MIN_RECORDS", "STATE_VERSION", "WINDOW", "Blames", "Chain", "hypothesis", "place"]

WINDOW = 200  # steps: the same fault from fresh records this soon after a quarantine withdraws its blame
MIN_RECORDS = 4  # the quarantined share is judged past this many records (0.5% of a tiny dataset is under one)
STATE_VERSION = 1  # the format of ``Blames.state_dict``


def hypothesis(d: Diagnosis) -> bool:
    """``d`` blames records that do not hold NaN/inf themselves: a hypothesis a remedy can refute."""
    return d.caused_by_data and not d.state_damaged and not is_measured(d)


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

    def to_state(self, key: tuple[str, str]) -> dict[str, Any]:
        """Primitives only (a checkpoint loads with ``weights_only=True``)."""
        return {
            "cause": key[0],
            "place": key[1],
            "steps": list(self.steps),
            "samples": [[k, i] for k, i in self.samples],
            "prints": list(self.prints),
            "withdrawn": self.withdrawn,
            "release_due": self.release_due,
        }

    @staticmethod
    def from_state(state: object) -> tuple[tuple[str, str], Chain]:
        """The chain ``to_state`` wrote, or ``ValueError`` naming the malformed field."""
        if not isinstance(state, dict):
            raise ValueError(f"a chain is a {type(state).__name__}, not a dict")
        cause, where = state.get("cause"), state.get("place")
        steps, samples, prints = state.get("steps"), state.get("samples"), state.get("prints")
        withdrawn, due = state.get("withdrawn"), state.get("release_due", False)
        if not (isinstance(cause, str) and isinstance(where, str)):
            raise ValueError("a chain's cause and place are not strings")
        if not (isinstance(steps, list) and all(_int(x) for x in steps)):
            raise ValueError(f"the chain of {cause}: 'steps' is not a list of integers")
        if not (isinstance(samples, list) and all(_sample(x) for x in samples)):
            raise ValueError(f"the chain of {cause}: 'samples' is not a list of [loader, index] pairs")
        if not (isinstance(prints, list) and all(isinstance(x, str) for x in prints)):
            raise ValueError(f"the chain of {cause}: 'prints' is not a list of strings")
        if not (withdrawn is None or _int(withdrawn)) or not isinstance(due, bool):
            raise ValueError(f"the chain of {cause}: 'withdrawn' or 'release_due' has the wrong type")
        chain = Chain(list(steps), [(str(k), int(i)) for k, i in samples], list(prints), withdrawn, due)
        return (cause, where), chain


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sample(x: object) -> bool:
    return isinstance(x, list | tuple) and len(x) == 2 and isinstance(x[0], str) and _int(x[1])


class Blames:
    """The fit's data hypotheses (``FitLedger.blames``)."""

    def __init__(self) -> None:
        self.chains: dict[tuple[str, str], Chain] = {}
        self.lines: list[str] = []  # for the end-of-fit summary

    def state_dict(self) -> dict[str, Any]:
        """The chains and the summary's lines, in primitives (``STATE_VERSION``)."""
        chains = [chain.to_state(key) for key, chain in self.chains.items()]
        return {"version": STATE_VERSION, "chains": chains, "lines": list(self.lines)}

    def load_state_dict(self, state: object) -> None:
        """Replace the chains with those ``state_dict`` wrote; ``ValueError`` naming what is malformed (nothing is
        changed then)."""
        if not isinstance(state, dict):
            raise ValueError(f"the blames are a {type(state).__name__}, not a dict")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"the blames' format {brief(state.get('version'))} is not {STATE_VERSION}")
        chains, lines = state.get("chains"), state.get("lines", [])
        if not isinstance(chains, list):
            raise ValueError("the blames' 'chains' is not a list")
        if not (isinstance(lines, list) and all(isinstance(x, str) for x in lines)):
            raise ValueError("the blames' 'lines' is not a list of strings")
        self.chains = dict(Chain.from_state(c) for c in chains)
        self.lines = list(lines)

    def judge(self, findings: Findings, d: Diagnosis, step: int) -> Diagnosis:
        """``d``, withdrawn where its chain's quarantine did not stop the fault (before any new quarantine). The
        same cause at the same place counts as a recurrence whether or not this incident names its rows (a kept
        replay reused without them): the quarantined records are left out, so whatever met it is fresh."""
        if d.state_damaged or is_measured(d):
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

    def releases_due(self) -> list[Chain]:
        """The chains ``judge`` withdrew whose records are still held: released now (each once)."""
        due = [chain for chain in self.chains.values() if chain.release_due]
        for chain in due:
            chain.release_due = False
        return due

    def add(self, d: Diagnosis, step: int, samples: list[tuple[str, int]], prints: list[str]) -> Chain | None:
        """What this incident's quarantine added (``Quarantine.add``), into its chain where ``d`` is a hypothesis."""
        if not hypothesis(d) or not (samples or prints):
            return None
        chain = self.chains.setdefault(place(d), Chain())
        chain.steps.append(step)
        chain.samples.extend(samples)
        chain.prints.extend(prints)
        return chain

    def past_share(self, size: int, fraction: float) -> int | None:
        """The records the standing hypotheses hold, where they pass ``fraction`` of a dataset of ``size`` samples
        (never fewer than ``MIN_RECORDS``); ``None`` within it."""
        held = sum(len(c.samples) for c in self.chains.values() if c.withdrawn is None)
        return held if size and held > max(MIN_RECORDS, math.floor(fraction * size)) else None

    def withdraw(
        self, chain: Chain, d: Diagnosis, step: int, held: int, size: int, fraction: float, released: int
    ) -> str:
        """``chain`` withdrawn for passing the share (its ``released`` records let go): the line that says so."""
        chain.withdrawn = step
        line = (
            f"step {step}: records blamed as a hypothesis are {held} of {size} samples, past "
            f"max_quarantined_fraction={fraction:g}: a fault that many records trigger is not theirs; released the "
            f"{released} record(s) quarantined for {d.cause.value}"
        )
        self.lines.append(line)
        return line
