"""Rules on the step itself, with the state intact: what the signal says, what the batch shows, what the GradScaler
reported. Cheap: no replay is needed when one of them decides."""

from __future__ import annotations

import math

from lightning_nanguard.contract import SPIKES, Cause, Diagnosis, Evidence, EvidenceKind, Signal
from lightning_nanguard.policies.findings import Findings, at, batch_evidence, history_evidence, rows_by_rank

__all__ = [
    "diverging",
    "nonfinite_inputs",
    "outsized_inputs",
    "scaler_overflow",
    "scaler_overflow_climbing",
    "spike_or_collapse",
    "targets_out_of_range",
]


def spike_or_collapse(f: Findings) -> Diagnosis | None:
    """A spike or a loss-scale collapse: the history is the evidence."""
    if f.signal is not Signal.LOSS_SCALE_COLLAPSE and f.signal not in SPIKES:
        return None
    return Diagnosis(Cause.GRADIENT_EXPLOSION, evidence=(history_evidence(f),))


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def _times(value: float | None, reference: float | None) -> str:
    """``value`` as a multiple of ``reference`` (``"?"`` where no ratio means anything)."""
    if value is None or reference is None or reference <= 0 or not math.isfinite(value / reference):
        return "?"
    return f"{value / reference:.3g}x"


def diverging(f: Findings) -> Diagnosis | None:
    """A snapshot was taken mid-divergence: finite, but its step's loss and grad norm far above the last sound one's.
    No batch is to blame (the event comes before this batch runs) and nothing needs a replay: the history is the
    evidence."""
    if f.signal is not Signal.DIVERGING:
        return None
    history = history_evidence(f)
    d = f.divergence
    if d is None:
        return Diagnosis(Cause.GRADIENT_EXPLOSION, where="a snapshot taken mid-divergence", evidence=(history,))
    since = "" if d.reference_step is None else f" (step {d.reference_step})"
    now, ref = d.health, d.reference
    where = (
        f"the snapshot of step {d.step}: loss {_num(now.loss)}, grad norm {_num(now.grad_norm)}, against "
        f"{_num(ref.loss)} and {_num(ref.grad_norm)} at the last sound snapshot{since}"
    )
    seen = Evidence(
        EvidenceKind.HISTORY_RISING,
        f"step {d.step}: loss {_times(now.loss, ref.loss)} and grad norm {_times(now.grad_norm, ref.grad_norm)} "
        f"those of the last sound snapshot{since}, more than {d.factor:g}x in both: the run is diverging while "
        "finite",
        {
            "step": d.step,
            "loss": now.loss,
            "grad_norm": now.grad_norm,
            "reference_step": d.reference_step,
            "reference_loss": ref.loss,
            "reference_grad_norm": ref.grad_norm,
            "factor": d.factor,
        },
    )
    return Diagnosis(Cause.GRADIENT_EXPLOSION, where=where, evidence=(seen, history))


def _batch_rows(f: Findings, kind: EvidenceKind, attr: str, cause: Cause, hint: str = "") -> Diagnosis | None:
    """``cause`` at the batch rows the ``kind`` evidence names, that evidence first and the rest after it."""
    evidence = batch_evidence(f)
    found = next((e for e in evidence if e.kind is kind), None)
    if found is None:
        return None
    ranks, rows = rows_by_rank(f, attr)
    return Diagnosis(
        cause,
        where=at(f, ranks, rows),
        hint=hint,
        evidence=(found, *(e for e in evidence if e is not found)),
        ranks=ranks,
        rows=rows,
    )


def nonfinite_inputs(f: Findings) -> Diagnosis | None:
    """NaN/inf in an input row."""
    return _batch_rows(f, EvidenceKind.BATCH_NONFINITE, "nonfinite_rows", Cause.INPUT_DATA)


def nonfinite_targets(f: Findings) -> Diagnosis | None:
    """NaN/inf in a target row (a float regression target)."""
    hint = "the targets hold NaN/inf: check the label pipeline for these samples"
    return _batch_rows(f, EvidenceKind.TARGETS_NONFINITE, "nonfinite_target_rows", Cause.TARGETS, hint)


def targets_out_of_range(f: Findings) -> Diagnosis | None:
    """Class targets < 0 or >= the model's output size (``ignore_index`` -100 excepted)."""
    return _batch_rows(f, EvidenceKind.TARGETS_OUT_OF_RANGE, "target_rows", Cause.TARGETS)


def outsized_inputs(f: Findings) -> Diagnosis | None:
    """A row ``1e3`` x larger than the batch's median row. Not under half precision, where a large-but-finite row may
    only overflow the half dtype: the replay decides that (``diagnosis.classify`` keeps the rows as evidence)."""
    if f.half_precision:
        return None
    return _batch_rows(f, EvidenceKind.BATCH_MAGNITUDE, "magnitude_rows", Cause.INPUT_DATA)


def _scale(f: Findings) -> str:
    return f"{f.scale:g}" if f.scale is not None else "?"


def scaler_overflow_climbing(f: Findings) -> Diagnosis | None:
    """A GradScaler overflow with a finite loss that was climbing (3x, rising 3 steps in a row): the overflows are
    the symptom, the loss itself was climbing into them."""
    if not (f.scaler_overflow and f.history.loss_rising):
        return None
    scale = _scale(f)
    return Diagnosis(
        Cause.GRADIENT_EXPLOSION,
        where=f"gradients at loss scale {scale}, the loss climbing",
        evidence=(
            history_evidence(f),
            Evidence(EvidenceKind.LOSS_SCALE, f"the scaled gradients overflowed at loss scale {scale}"),
        ),
    )


def scaler_overflow(f: Findings) -> Diagnosis | None:
    """A GradScaler overflow with a finite loss: routine for 16-mixed, no replay needed."""
    if not f.scaler_overflow:
        return None
    scale = _scale(f)
    return Diagnosis(
        Cause.HALF_PRECISION_OVERFLOW,
        where=f"gradients at loss scale {scale}",
        evidence=(Evidence(EvidenceKind.LOSS_SCALE, f"the scaled gradients overflowed at loss scale {scale}"),),
        hint="routine for fp16 with a GradScaler: it dropped the update and lowered its scale",
    )
