"""A data blame is a hypothesis: the step is replayed without the blamed rows before anything is quarantined.

Where a diagnosis blames records (a data cause, or valid records that trigger a formula bug), the step's batch is
replayed once more without them (``forensics.replay.run_pass``, the same pass the diagnosis replays with: no
``.grad``, no buffer, no RNG state written). The records are quarantined only if that makes the step finite, and the
counterfactual is kept in the incident (``Diagnosis.counterfactual`` and its evidence). Where it stays non-finite the
records are not the cause: the blame is dropped, nothing is quarantined, and the cause is decided again from the
other evidence (``policies.diagnosis.classify`` on the findings without the blamed rows). Where no replay is possible
(gradient accumulation, ``forensics="off"``, the replay budget spent, a batch that cannot be replayed or cut), the incident says so, and only records that themselves hold NaN/inf (a measurement, not a
hypothesis) are quarantined.

Incident path only, and only for a blame with rows to take out and a sound state; rank-consistent: whether to test is
decided from gathered values, each rank replays its own batch without its own rows, and one all-gather makes the
verdict every rank's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_nanguard import _distributed
from lightning_nanguard.contract import Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.engine.context import IncidentContext
from lightning_nanguard.engine.events import EventFacts
from lightning_nanguard.forensics.replay import run_pass
from lightning_nanguard.policies.counterfactual import redecide, untested
from lightning_nanguard.policies.findings import Findings, PassResult
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = ["test_blame", "without_rows"]


def without_rows(batch: object, rows: tuple[int, ...]) -> object:
    """``batch`` without ``rows`` along the batch dimension (every tensor whose first dimension is the batch's), or
    ``None`` where it cannot be cut (no tensor, no row left, a row out of range)."""
    sizes = [t.shape[0] for t in iter_tensors(batch) if t.dim() > 0]
    if not sizes or not rows:
        return None
    size = sizes[0]
    keep = [i for i in range(size) if i not in set(rows)]
    if not keep or any(r < 0 or r >= size for r in rows):
        return None

    def cut(obj: object) -> Any:
        if isinstance(obj, Tensor):
            return obj[torch.tensor(keep, device=obj.device)] if obj.dim() > 0 and obj.shape[0] == size else obj
        if isinstance(obj, Mapping):
            return type(obj)({k: cut(v) for k, v in obj.items()}) if isinstance(obj, dict) else obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(cut(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(cut(v) for v in obj)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: cut(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
        return obj

    return cut(batch)


def _my_rows(trainer: pl.Trainer, d: Diagnosis) -> tuple[int, ...]:
    rank = trainer.global_rank
    if d.rank_rows and rank < len(d.rank_rows):
        return d.rank_rows[rank]
    return d.rows if not d.ranks or rank in d.ranks else ()


def _why_not(pl_module: pl.LightningModule, facts: EventFacts, findings: Findings) -> str:
    """Why no replay can test the blame ("" when one can): the same conditions as the diagnosis' own replay, which
    must have run (or been reused) for this event: a blame no replay reproduced is not tested either."""
    if not facts.readings:
        return "no training step at hand"
    if not findings.replay:
        why = findings.note.removesuffix(": cheap evidence only").removeprefix("replay skipped (").removesuffix(")")
        return why or "no replay ran"
    return ""


def test_blame(ctx: IncidentContext, findings: Findings, d: Diagnosis) -> Diagnosis:
    """``d``, its data blame tested (see the module's docstring). Every rank calls it with the same ``d``."""
    trainer, pl_module, facts, registry, ledger = ctx.trainer, ctx.pl_module, ctx.facts, ctx.registry, ctx.ledger
    if not d.caused_by_data or registry.quarantine is None or not facts.state_ok or d.state_damaged or not d.rows:
        return d
    mine = _my_rows(trainer, d)
    why = _why_not(pl_module, facts, findings)
    cut = without_rows(facts.batch, mine) if mine and not why else None
    local = (why, bool(mine), cut is not None or not mine)
    gathered = cast(list[tuple[str, bool, bool]], _distributed.all_gather_objects(trainer, local))
    why = next((w for w, _, _ in gathered if w), "")
    if not why and not all(ok for _, _, ok in gathered):
        why = "the batch cannot be cut without those rows"
    if why:
        return untested(d, why)
    if not any(r.hooked is not None and r.hooked.reproduced for r in findings.replay):
        ev = Evidence(
            EvidenceKind.COUNTERFACTUAL,
            "the step replayed with these records is finite too: they are not its cause (nothing quarantined)",
            {"rows": list(d.rows), "finite": True, "tested": True},
        )
        return redecide(findings, d, ev, {"rows": list(d.rows), "tested": True, "finite": True, "quarantine": False})
    result = (
        run_pass(trainer, pl_module, cut, facts.batch_idx, float32=False, scale=findings.scale)
        if cut is not None
        else PassResult()
    )
    passes = cast(list[PassResult], _distributed.all_gather_objects(trainer, result))
    ms = round(max(p.ms for p in passes), 3)
    ledger.replays.spent_ms += ms
    errors = [p.error for p in passes if p.error]
    if errors:
        return untested(d, f"the replay without the rows failed: {errors[0]}")
    finite = not any(p.reproduced for p in passes)
    where = f"batch {facts.batch_idx} rows {list(d.rows)}"
    record = {"rows": list(d.rows), "finite": finite, "tested": True, "replay_ms": ms}
    if finite:
        ev = Evidence(
            EvidenceKind.COUNTERFACTUAL,
            f"replayed without {where}: the step is finite, so these records are its cause",
            record,
        )
        return dataclasses.replace(d, evidence=(*d.evidence, ev), counterfactual={**record, "quarantine": True})
    ev = Evidence(
        EvidenceKind.COUNTERFACTUAL,
        f"replayed without {where}: the step is still non-finite, so these records are not its cause (nothing "
        "quarantined)",
        record,
    )
    return redecide(findings, d, ev, {**record, "quarantine": False})
