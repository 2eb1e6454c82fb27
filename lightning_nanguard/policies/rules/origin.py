"""Rules on the origin of the first non-finite value: the op, the line and the statistics a traced replay found
(``policies.origin``). Tried right after the state and the step's own signals, before the batch's evidence and the
coarse replay rules: where the origin shows a pattern, the cause is certain.

A formula that fails on some valid records (a norm without eps meeting an all-zero record, a fully masked row) is
not bad data: the cause is the formula, and the hint names the fix. The records that trigger it are named and, when
they are a few rows of the batch (not all of it), quarantined as its trigger (``Diagnosis.caused_by_data``), so the
run goes on without meeting them again; the incident says so. None of these causes calls for a rollback or a lower
learning rate: their ``CauseSpec`` (``policies.causes``) drops the update and nothing more.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_nanguard.contract import Cause, Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.policies.findings import Findings, at, batch_evidence, history_evidence, rows_by_rank
from lightning_nanguard.policies.origin import Origin, OriginVerdict
from lightning_nanguard.policies.rules import origin_patterns as patterns

__all__ = [
    "formula",
    "half_precision_overflow",
    "nonfinite_input",
    "nonfinite_target",
    "origin_evidence",
    "origin_record",
    "overflow_past_float32",
    "shown",
    "targets_at_the_origin",
    "traced",
]

Hit = tuple[int, Origin, OriginVerdict]  # (rank, origin, its verdict)
Pattern = Callable[[Origin], OriginVerdict | None]
FLOAT32_SAFE = 1.8e19  # sqrt(float32's max): a product (or square) of values up to this is finite in float32


def traced(f: Findings) -> list[tuple[int, Origin]]:
    """The origins the replay traced, with their rank (rank order)."""
    return [
        (r, p.hooked.origin) for r, p in enumerate(f.replay) if p.hooked is not None and p.hooked.origin is not None
    ]


def shown(f: Findings, pattern: Pattern) -> list[Hit]:
    """The traced origins that show ``pattern``, with their rank and verdict (rank order)."""
    hits = [(r, o, pattern(o)) for r, o in traced(f)]
    return [(r, o, v) for r, o, v in hits if v is not None]


def origin_record(rank: int, origin: Origin, verdict: OriginVerdict) -> dict[str, object]:
    """``Diagnosis.origin``: the origin's plain values and its verdict."""
    return {
        **origin.to_dict(),
        "rank": rank,
        "kind": verdict.kind,
        "data_at_fault": verdict.data_at_fault,
        "summary": verdict.summary,
    }


def origin_evidence(origin: Origin, verdict: OriginVerdict) -> Evidence:
    frame = origin.frame
    return Evidence(
        EvidenceKind.ORIGIN,
        verdict.summary,
        {
            "op": origin.op,
            "phase": origin.phase,
            "pattern": verdict.kind,
            "file": frame.file if frame else "",
            "line": frame.line if frame else 0,
            "function": frame.function if frame else "",
            "code": frame.code if frame else "",
            "node": origin.node,
            "module": origin.module,
            "rows": list(origin.rows),
            "stats": dict(origin.stats),
        },
    )


def _fp32(f: Findings, ranks: tuple[int, ...]) -> Evidence | None:
    """What the float32 pass of these ranks showed, when one ran."""
    passes = [f.replay[r].fp32 for r in ranks if f.replay[r].fp32 is not None]
    if not passes:
        return None
    if any(p is not None and p.reproduced for p in passes):
        return Evidence(EvidenceKind.REPLAY_FP32_NONFINITE, "the same batch is non-finite in float32 too")
    return Evidence(EvidenceKind.REPLAY_FP32_FINITE, "the same batch is finite in float32")


def _formula(f: Findings, pattern: Pattern, cause: Cause) -> Diagnosis | None:
    """``cause`` where the origin shows its ``pattern``: the op and its line, the records that trigger it
    (quarantined as its trigger), the precision-aware hint of its verdict."""
    hits = shown(f, pattern)
    if not hits:
        return None
    rank, origin, verdict = hits[0]
    ranks = tuple(r for r, _, _ in hits)
    per_rank = {r: o.trigger_rows for r, o, _ in hits}
    rows = tuple(sorted({i for rs in per_rank.values() for i in rs}))
    several = len(f.replay) > 1
    rank_rows = tuple(per_rank.get(r, ()) for r in range(len(f.replay))) if several and rows else ()
    if rows:
        trigger_ranks = tuple(r for r in ranks if per_rank[r])
        where = f"{origin.where}, {at(f, trigger_ranks, rows)}"
        note = (
            f"the data is valid: {'these records trigger' if len(rows) > 1 else 'this record triggers'} a formula bug"
        )
    else:
        where = f"{origin.where}" + (f" on rank {rank}" if several else "")
        note = "every row of the batch meets it: the formula is at fault, nothing is quarantined" if origin.rows else ""
    evidence = [origin_evidence(origin, verdict)]
    fp32 = _fp32(f, ranks)
    if fp32 is not None:
        evidence.append(fp32)
    return Diagnosis(
        cause,
        where=where,
        evidence=tuple(evidence),
        hint=verdict.hint,
        ranks=ranks,
        module=origin.module,
        rows=rows,
        note=note,
        caused_by_data=bool(rows),
        rank_rows=rank_rows,
        origin=origin_record(rank, origin, verdict),
    )


def formula(cause: Cause, pattern: Pattern | None) -> Callable[[Findings], Diagnosis | None]:
    """The evidence rule of a formula cause: the origin shows its pattern (``CauseSpec.pattern``)."""
    assert pattern is not None, f"{cause.value} declares no origin pattern"

    def rule(f: Findings) -> Diagnosis | None:
        return _formula(f, pattern, cause)

    rule.__name__ = rule.__qualname__ = cause.value
    rule.__doc__ = pattern.__doc__
    return rule


def targets_at_the_origin(f: Findings) -> Diagnosis | None:
    """Class targets out of range whose rows are the very records the measured origin names (an all-zero one-hot row
    of a label the head does not have, divided by its sum): the measurement confirms the labels are to blame. Class
    targets out of range that the origin does not name are a heuristic, tried only where nothing was measured."""
    ranks, rows = rows_by_rank(f, "target_rows")
    if not rows:
        return None
    for rank, origin in traced(f):
        named = set(origin.trigger_rows)
        if origin.phase in ("input", "state") or not named:
            continue
        summary = f"the origin, {origin.where}, is met by exactly these records (rows {sorted(named)})"
        verdict = OriginVerdict("targets", True, summary, "", origin.rows)
        if rank < len(f.batch) and named <= set(f.batch[rank].target_rows):
            evidence = [e for e in batch_evidence(f) if e.kind is EvidenceKind.TARGETS_OUT_OF_RANGE]
            return Diagnosis(
                Cause.TARGETS,
                where=at(f, ranks, rows),
                evidence=(*evidence, origin_evidence(origin, verdict)),
                ranks=ranks,
                rows=rows,
                origin=origin_record(rank, origin, verdict),
            )
    return None


def _input_hits(f: Findings) -> list[Hit]:
    return shown(f, patterns.nonfinite_input)


def _input(f: Findings, cause: Cause, attr: str, hint: str = "") -> Diagnosis | None:
    """``cause`` at the batch rows the cheap evidence names (the origin's, where it names none), the batch's
    evidence first, then the origin's: the field, and the op (and line) that first used it."""
    hits = _input_hits(f)
    if not hits:
        return None
    rank, origin, verdict = hits[0]
    ranks, rows = rows_by_rank(f, attr)
    if not rows:
        rows, ranks = origin.rows, tuple(r for r, _, _ in hits)
    return Diagnosis(
        cause,
        where=at(f, ranks, rows),
        evidence=(*batch_evidence(f), origin_evidence(origin, verdict)),
        hint=hint,
        ranks=ranks,
        rows=rows,
        origin=origin_record(rank, origin, verdict),
    )


def nonfinite_input(f: Findings) -> Diagnosis | None:
    """A NaN/inf already in the step's inputs (an -inf-only field, an additive mask, is no such thing): the data."""
    targets_only = rows_by_rank(f, "nonfinite_target_rows")[1] and not rows_by_rank(f, "nonfinite_rows")[1]
    return None if targets_only else _input(f, Cause.INPUT_DATA, "nonfinite_rows")


def nonfinite_target(f: Findings) -> Diagnosis | None:
    """A NaN/inf already in the step's targets (and none in its inputs)."""
    if not rows_by_rank(f, "nonfinite_target_rows")[1]:
        return None
    hint = "the targets hold NaN/inf: check the label pipeline for these samples"
    return _input(f, Cause.TARGETS, "nonfinite_target_rows", hint)


def _overflows(f: Findings, *, half: bool) -> list[Hit]:
    return shown(f, patterns.half_precision_overflow if half else patterns.overflow_past_float32)


def half_precision_overflow(f: Findings) -> Diagnosis | None:
    """Arithmetic past a half dtype's max (an ``mm``, a square) that the float32 replay does not overflow: the op's
    module runs in float32 once it recurs."""
    hits = _overflows(f, half=True)
    if not hits or not f.half_precision:
        return None
    ranks = tuple(r for r, _, _ in hits)
    rank, origin, verdict = hits[0]
    fp32 = _fp32(f, ranks)
    if fp32 is None:  # no float32 pass (its budget): the op's own inputs say whether float32 holds it
        biggest = origin.stat("max_abs_input")
        if not isinstance(biggest, (int, float)) or biggest > FLOAT32_SAFE:
            return None
        fp32 = Evidence(
            EvidenceKind.REPLAY_FP32_FINITE,
            f"no float32 pass ran; the op's inputs (up to {biggest:.4g}) cannot overflow it in float32",
        )
    if fp32.kind is not EvidenceKind.REPLAY_FP32_FINITE:
        return None
    on = f" on rank {rank}" if len(f.replay) > 1 else ""
    return Diagnosis(
        Cause.HALF_PRECISION_OVERFLOW,
        where=f"{origin.module or '<the LightningModule>'}{on}: {origin.where} (finite in float32)",
        evidence=(origin_evidence(origin, verdict), fp32),
        hint=verdict.hint,
        ranks=ranks,
        module=origin.module,
        origin=origin_record(rank, origin, verdict),
    )


def overflow_past_float32(f: Findings) -> Diagnosis | None:
    """Arithmetic past float32's max: values that large are growth, the evidence an explosion needs."""
    hits = _overflows(f, half=False)
    if not hits:
        return None
    rank, origin, verdict = hits[0]
    on = f" on rank {rank}" if len(f.replay) > 1 else ""
    return Diagnosis(
        Cause.GRADIENT_EXPLOSION,
        where=f"{origin.module or '<the LightningModule>'}{on}: {origin.where}",
        evidence=(origin_evidence(origin, verdict), history_evidence(f)),
        hint=verdict.hint,
        ranks=tuple(r for r, _, _ in hits),
        module=origin.module,
        origin=origin_record(rank, origin, verdict),
    )
