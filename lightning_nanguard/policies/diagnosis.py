"""The cause of one event from its findings: a pure function, ``Findings`` in, ``Diagnosis`` out.

``classify`` walks the evidence rules in their declared order (``policies.causes.EVIDENCE``, first match wins;
docs/FORENSICS.md has the table), then completes the verdict with what is context for any cause: outsized input rows
under half precision, a head far larger than the labels in use, the hint of the cause, each rank's own rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning_nanguard.contract import Basis, Cause, Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.policies.causes import CAUSES, EVIDENCE, Stage
from lightning_nanguard.policies.findings import Findings, ReplayFindings, at, batch_evidence, rows_by_rank
from lightning_nanguard.policies.rules.replay import replay_usable
from lightning_nanguard.signals.history import HistoryFindings

__all__ = [
    "classify",
    "divergence_diagnosis",
    "listed_names",
    "needs_replay",
    "offline_diagnosis",
    "replay_steps",
    "signature",
    "strip_rows",
]

HEAD_RATIO = 10  # a head at least this many times the largest label in use (and >= HEAD_MIN outputs) is oversized
HEAD_MIN = 100


def _decide(f: Findings, stages: tuple[Stage, ...]) -> Diagnosis | None:
    """The first rule (in ``EVIDENCE``'s ranked order) whose evidence is there, its ``basis`` as ``decided_by``."""
    usable = replay_usable(f)
    for rule in EVIDENCE:
        if rule.stage in stages and (usable or rule.stage is not Stage.REPLAY):
            found = rule.decide(f)
            if found is not None:
                return replace(found, decided_by=rule.basis)
    return None


def needs_replay(f: Findings) -> bool:
    """The cheap evidence does not settle the cause: no cheap rule placed before the first replay rule decides (the
    batch's own evidence comes after the origin, so a batch with a NaN is replayed too, to trace where it went)."""
    for rule in EVIDENCE:
        if rule.stage is not Stage.CHEAP:
            return True
        if rule.decide(f) is not None:
            return False
    return True


def signature(f: Findings) -> tuple[object, ...]:
    """The evidence signature ``forensics="first"`` caches a replay under (rank-consistent fields only)."""
    kinds = tuple(sorted(e.kind.value for e in batch_evidence(f)))
    return (f.signal.value, f.state_ok, f.scaler_overflow, f.precision, kinds)


def classify(f: Findings) -> Diagnosis:
    """The diagnosis of one event (pure: the same ``Findings`` give the same ``Diagnosis`` on every rank)."""
    d = _decide(f, (Stage.CHEAP, Stage.REPLAY, Stage.LAST))
    assert d is not None  # the last rule always decides
    d = _with_magnitude_rows(f, d)
    evidence, hint = d.evidence, d.hint or CAUSES[d.cause].hint
    head = _head_oversized(f)
    if head is not None:  # context for any cause, never a cause by itself: one batch's labels are not all labels
        evidence = (*evidence, head)
        hint = f"{hint}; {head.summary}: check num_classes"
    return Diagnosis(
        d.cause,
        where=d.where,
        evidence=evidence,
        hint=hint,
        ranks=d.ranks or f.ranks,
        module=d.module,
        rows=d.rows,
        state_tensors=d.state_tensors,
        state_damaged=d.state_damaged or not f.state_ok,
        replayed=f.replayed_now,
        replay_ms=f.replay_ms,
        replay_steps=f.replay_steps,
        note="; ".join(x for x in (d.note, f.note) if x),
        caused_by_data=d.caused_by_data or CAUSES[d.cause].data_at_fault,  # never "input_data, not by data"
        rank_rows=d.rank_rows or _rank_rows(f, d.rows),
        origin=d.origin,
        decided_by=d.decided_by,
        counterfactual=d.counterfactual,
    )


def _rank_rows(f: Findings, rows: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each rank's own implicated rows (row numbers repeat across ranks, the samples behind them do not)."""
    if len(f.batch) <= 1 or not rows:
        return ()
    wanted = set(rows)
    return tuple(tuple(sorted(wanted & set(b.rows))) for b in f.batch)


def _with_magnitude_rows(f: Findings, d: Diagnosis) -> Diagnosis:
    """Half precision: outsized rows are the trigger of an overflow that is finite in float32 (kept as evidence), and
    the cause when they make the step non-finite in float32 too."""
    if not f.half_precision:
        return d
    found = next((e for e in batch_evidence(f) if e.kind is EvidenceKind.BATCH_MAGNITUDE), None)
    if found is None or CAUSES[d.cause].data_at_fault or d.cause in (Cause.CORRUPT_STATE, Cause.OPTIMIZER_NUMERICS):
        return d
    ranks, rows = rows_by_rank(f, "magnitude_rows")
    if d.origin:  # the origin named the op: the outsized rows are its trigger, not a cause of their own
        return replace(d, evidence=(*d.evidence, found))
    if d.cause is Cause.HALF_PRECISION_OVERFLOW:
        return replace(d, evidence=(*d.evidence, found), rows=rows)
    return Diagnosis(
        Cause.INPUT_DATA,
        where=at(f, ranks, rows),
        evidence=(found, *d.evidence),
        ranks=ranks,
        rows=rows,
        note=d.note,
        decided_by=Basis.HEURISTIC,
    )


def _head_oversized(f: Findings) -> Evidence | None:
    """The model's head is far larger than the labels in use (a 1000-class head on 10-class data)."""
    size = f.output_size
    labels = [b.target_max for b in f.batch if b.target_max is not None]
    if size is None or not labels or size < HEAD_MIN:
        return None
    used = max(labels) + 1
    if used * HEAD_RATIO > size:
        return None
    return Evidence(
        EvidenceKind.HEAD_OVERSIZED,
        f"the model has {size} outputs and the batch's labels use at most {used}",
        {"output_size": size, "labels_used": used},
    )


def replay_steps(ms: float, step_seconds: float) -> float | None:
    """``ms`` as a multiple of one training step (``None`` when the step time is unknown)."""
    if not math.isfinite(step_seconds) or step_seconds <= 0:
        return None
    return ms / (step_seconds * 1000.0)


def strip_rows(f: Findings) -> Findings:
    """``f`` without the batch's blame: no non-finite, outsized or out-of-range rows, no origin of phase ``input``
    and no triggering rows; the cause is then decided from the other evidence (a blame tested and withdrawn)."""
    batch = tuple(
        replace(b, nonfinite_rows=(), nonfinite_target_rows=(), magnitude_rows=(), target_rows=()) for b in f.batch
    )

    def clean(r: ReplayFindings) -> ReplayFindings:
        h = r.hooked
        if h is None or h.origin is None:
            return r
        origin = None if h.origin.phase == "input" else replace(h.origin, rows=())
        return replace(r, hooked=replace(h, origin=origin))

    return replace(f, batch=batch, replay=tuple(clean(r) for r in f.replay))


# Evidence a bundle does not hold: a cause decided on it online is the incident's, offline too.
_NOT_IN_A_BUNDLE = (Basis.STATE, Basis.SIGNAL, Basis.HISTORY)


def offline_diagnosis(recorded: Mapping[str, Any], f: Findings) -> Diagnosis:
    """The cause of an incident's step replayed offline (``nanguard replay BUNDLE``), by the incident's own rules.

    ``f``: what the bundle's replay found (its passes, the batch's evidence); ``recorded``: the incident's diagnosis
    (``Diagnosis.to_dict()``, in the bundle's manifest). What the bundle cannot hold is taken from the record: a
    cause decided on the state, the step's signals or the history stands as the incident named it; a rising history
    is given to the rules; a data blame the incident tested and withdrew (``counterfactual``) is withdrawn here too.
    So the online incident and its offline replay name the same cause, place and data at fault."""
    basis = Basis(str(recorded.get("decided_by") or Basis.NONE.value))
    if basis in _NOT_IN_A_BUNDLE and recorded.get("cause"):
        return Diagnosis(
            Cause(str(recorded["cause"])),
            where=str(recorded.get("where", "")),
            hint=str(recorded.get("hint", "")),
            rows=tuple(int(r) for r in recorded.get("rows") or ()),
            caused_by_data=bool(recorded.get("caused_by_data")),
            note=f"decided by evidence a bundle does not hold ({basis.value}): as the incident named it",
            decided_by=basis,
        )
    kinds = {str(e.get("kind")) for e in recorded.get("evidence") or () if isinstance(e, Mapping)}
    if EvidenceKind.HISTORY_RISING.value in kinds:
        f = replace(f, history=HistoryFindings(grad_norm_rising=True))
    withdrawn = (recorded.get("counterfactual") or {}).get("quarantine") is False
    if withdrawn:
        return replace(classify(strip_rows(f)), caused_by_data=False, rows=(), rank_rows=())
    return classify(f)


def listed_names(names: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: the count of the names left out, so a line never reads as the whole list."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def divergence_diagnosis(names: tuple[str, ...]) -> Diagnosis:
    """The diagnosis of a rank divergence: the state is damaged (the ranks no longer train one model)."""
    listed = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
    return Diagnosis(
        Cause.CORRUPT_STATE,
        where=f"{listed_names(names)}: the ranks' copies differ",
        evidence=(Evidence(EvidenceKind.RANKS_DIVERGED, f"differ across ranks: {listed}", {"tensors": names}),),
        hint=(
            "something changed one rank's copy only (a rank-local write, a fault after the gradient all-reduce); "
            "DDP never re-broadcasts parameters, so the ranks would train different models from here on"
        ),
        state_tensors=names,
        state_damaged=True,
    )
