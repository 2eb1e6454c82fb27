"""The cause of one event from its evidence: a pure function, ``Findings`` in, ``Diagnosis`` out.

The rules, first match wins (cheapest evidence first; docs/FORENSICS.md has the table with the hints):

===========================  ==========================================================================================
cause                        decided by
===========================  ==========================================================================================
corrupt state (checkpoint)   state non-finite and no finite step since resuming from a checkpoint
optimizer numerics           state non-finite, the step before was finite, and the Adam update recomputed from the
                             (finite) moments is non-finite for the damaged parameters or eps underflows in their dtype
corrupt state                state non-finite otherwise (tensors named; buffers name their module and the batch rows
                             that wrote them, when the batch shows any)
gradient explosion           a spike or loss-scale collapse signal (the history is the evidence)
gradient explosion           a snapshot taken mid-divergence (its step's loss and grad norm both >10x those of the
                             last sound snapshot: the run is diverging while still finite)
input data                   NaN/inf in an input row (``signals.batch.split_batch`` says which parts are targets)
targets                      NaN/inf in a target row (a float regression target)
targets                      class targets < 0 or >= the output size the replay saw (ignore_index -100 excepted)
input data                   a row ``1e3`` x larger than the batch's median row
gradient explosion           a GradScaler overflow with a finite loss that was climbing (3x, rising 3 steps in a row)
half-precision overflow      a GradScaler overflow with a finite loss (no replay needed: routine for 16-mixed)
gradient explosion           the replay was finite, but gradients or outputs reached 1e15 (a norm of them overflows)
transient                    the replay (pre-update weights, same batch) was finite on every rank
gradient explosion           the replay: every module output finite but one reached 1e15, the loss not (divergence)
loss function                the replay reproduced a non-finite loss while every module output was finite
half-precision overflow      the replay names a module under a half precision and the float32 replay is finite
gradient explosion           the replay is non-finite in float32 too (divergence), module named
gradient explosion           no replay, the grad norm or loss was rising over the last finite steps
unknown                      nothing above
===========================  ==========================================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from lightning_nanguard.contract import Cause, Diagnosis, Divergence, Evidence, EvidenceKind, Signal
from lightning_nanguard.signals.batch import BatchFindings
from lightning_nanguard.signals.history import HistoryFindings
from lightning_nanguard.signals.state import StateFindings

__all__ = [
    "HINTS",
    "Findings",
    "PassResult",
    "ReplayFindings",
    "classify",
    "needs_replay",
    "replay_steps",
    "signature",
]

_SPIKES = (Signal.LOSS_SPIKE, Signal.GRAD_NORM_SPIKE, Signal.LOSS_AND_GRAD_NORM_SPIKE)

HINTS: dict[Cause, str] = {
    Cause.INPUT_DATA: "check the data pipeline for these samples (NaN/inf or unnormalised values in the inputs)",
    Cause.TARGETS: "the labels do not fit the model's output: check num_classes against the dataset's labels",
    Cause.HALF_PRECISION_OVERFLOW: (
        "the module overflows float16 but is finite in float32: run it in float32 (FP32Evaluation(promote_after=...)"
        " under *-mixed), use bf16, or normalise its input"
    ),
    Cause.LOSS_FUNCTION: (
        "every module output is finite but the loss is not: guard the loss (clamp before log, eps in divisions, "
        "log_softmax instead of log(softmax))"
    ),
    Cause.GRADIENT_EXPLOSION: "lower the learning rate, clip gradients, warm up longer, or use a bigger batch",
    Cause.OPTIMIZER_NUMERICS: (
        "the optimizer's update is non-finite from finite gradients: raise Adam eps to one representable in the "
        "parameter dtype (1e-4 for float16, OptimizerBackoff does it) or keep float32 master weights (*-mixed)"
    ),
    Cause.CORRUPT_STATE: (
        "restore an earlier state (AutoRollback does it in memory); check what wrote the non-finite values"
    ),
    Cause.TRANSIENT: "the same batch on the same weights was finite: a one-off (hardware, race, injected fault)",
    Cause.UNKNOWN: "check the data and the model at this step (forensics='every' replays each incident)",
}


TARGETS_NONFINITE_HINT = "the targets hold NaN/inf: check the label pipeline for these samples"


@dataclass(frozen=True)
class PassResult:
    """One replay pass on one rank, as plain values."""

    reproduced: bool = False  # the loss, a module output or a gradient was non-finite
    loss_finite: bool = True
    outputs_finite: bool = True
    grads_finite: bool = True
    first_module: str = ""  # the first module with a non-finite output (forward order), else by gradient
    first_kind: str = ""  # "output" | "gradient" | "parameter gradient"
    input_min: float | None = None
    input_max: float | None = None
    dtype: str = ""  # the first module's output dtype
    grad_params: tuple[str, ...] = ()  # parameters with non-finite gradients (the first few)
    out_size: int | None = None  # the last dim of the LightningModule's own forward output
    max_abs_output: float = 0.0  # the largest finite |value| any module output held
    max_abs_module: str = ""  # ... and the module that output it
    max_abs_grad: float = 0.0  # the largest finite |gradient| of any parameter (unscaled)
    ms: float = 0.0
    error: str = ""  # the pass raised: the exception, in one line


@dataclass(frozen=True)
class ReplayFindings:
    """One rank's replay: the pass in the training precision, then (maybe) the float32 one."""

    hooked: PassResult | None = None
    fp32: PassResult | None = None
    ms: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class Findings:
    """Everything one event's diagnosis rests on; per-rank parts are tuples in rank order (identical on all ranks)."""

    signal: Signal
    ranks: tuple[int, ...] = (0,)  # ranks whose reading was non-finite
    state_ok: bool = True
    state: StateFindings = field(default_factory=StateFindings)
    last_step_finite: bool = False  # the step before this one was finite (its update made the state what it is)
    batch: tuple[BatchFindings, ...] = ()
    history: HistoryFindings = field(default_factory=HistoryFindings)
    resumed_from: str | None = None
    finite_steps: int = 0
    batch_idx: int = -1
    scale: float | None = None
    scaler_overflow: bool = False
    half_precision: bool = False  # the run trains in *-mixed or *-true half precision
    precision: str = "32-true"
    replay: tuple[ReplayFindings, ...] = ()  # per rank; empty when no replay (result) is at hand
    replayed_now: bool = False  # a replay ran for this event (not a cached one)
    replay_ms: float | None = None
    replay_steps: float | None = None
    step_seconds: float = math.nan  # one training step's time, the slowest rank's (NaN: unknown)
    output_size: int | None = None  # the model's output size as a replay saw it
    note: str = ""  # why no replay, or whose replay is reused
    divergence: Divergence | None = None  # a ``diverging`` event: the snapshot judged and the reference it failed


def signature(f: Findings) -> tuple[object, ...]:
    """The evidence signature ``forensics="first"`` caches a replay under (rank-consistent fields only)."""
    kinds = tuple(sorted(e.kind.value for e in _cheap_evidence(f)))
    return (f.signal.value, f.state_ok, f.scaler_overflow, f.precision, kinds)


def needs_replay(f: Findings) -> bool:
    """The cheap evidence does not settle the cause."""
    return _cheap_cause(f) is None


def classify(f: Findings) -> Diagnosis:
    """The diagnosis of one event (pure: the same ``Findings`` give the same ``Diagnosis`` on every rank)."""
    d = _cheap_cause(f) or _replay_cause(f) or _fallback(f)
    d = _with_magnitude_rows(f, d)
    evidence, hint = d.evidence, d.hint or HINTS[d.cause]
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
        caused_by_data=d.caused_by_data,
        rank_rows=_rank_rows(f, d.rows),
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
    found = next((e for e in _cheap_evidence(f) if e.kind is EvidenceKind.BATCH_MAGNITUDE), None)
    if found is None or d.cause in (Cause.CORRUPT_STATE, Cause.INPUT_DATA, Cause.TARGETS, Cause.OPTIMIZER_NUMERICS):
        return d
    ranks, rows = _rows_by_rank(f, "magnitude_rows")
    if d.cause is Cause.HALF_PRECISION_OVERFLOW:
        return replace(d, evidence=(*d.evidence, found), rows=rows)
    return Diagnosis(
        Cause.INPUT_DATA, where=_at(f, ranks, rows), evidence=(found, *d.evidence), ranks=ranks, rows=rows, note=d.note
    )


# ---------------------------------------------------------------------------------------------- cheap evidence
HUGE_OUTPUT = 1e15  # a finite activation this large is divergence (its square is within 1e8 of float32's max)
HEAD_RATIO = 10  # a head at least this many times the largest label in use (and >= HEAD_MIN outputs) is oversized
HEAD_MIN = 100


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


def _rows_by_rank(f: Findings, attr: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ranks = tuple(r for r, b in enumerate(f.batch) if getattr(b, attr))
    rows = tuple(sorted({i for b in f.batch for i in getattr(b, attr)}))
    return ranks, rows


def _at(f: Findings, ranks: tuple[int, ...], rows: tuple[int, ...]) -> str:
    on = f"rank {', '.join(map(str, ranks))} " if len(f.batch) > 1 and ranks else ""
    return f"{on}batch {f.batch_idx} rows {list(rows)}"


def _cheap_evidence(f: Findings) -> list[Evidence]:
    out: list[Evidence] = []
    ranks, rows = _rows_by_rank(f, "nonfinite_rows")
    if rows:
        out.append(
            Evidence(EvidenceKind.BATCH_NONFINITE, f"NaN/inf in the inputs at {_at(f, ranks, rows)}", {"rows": rows})
        )
    ranks, rows = _rows_by_rank(f, "nonfinite_target_rows")
    if rows:
        out.append(
            Evidence(EvidenceKind.TARGETS_NONFINITE, f"NaN/inf in the targets at {_at(f, ranks, rows)}", {"rows": rows})
        )
    ranks, rows = _rows_by_rank(f, "magnitude_rows")
    if rows:
        top = max(b.max_abs for b in f.batch)
        median = max(b.median_row_abs for b in f.batch)
        out.append(
            Evidence(
                EvidenceKind.BATCH_MAGNITUDE,
                f"inputs up to {top:.3g} at {_at(f, ranks, rows)}, against a median row of {median:.3g}",
                {"rows": rows, "max_abs": top, "median_row_abs": median},
            )
        )
    ranks, rows = _rows_by_rank(f, "target_rows")
    if rows:
        lo = min(b.target_min for b in f.batch if b.target_min is not None)
        hi = max(b.target_max for b in f.batch if b.target_max is not None)
        size = next((b.output_size for b in f.batch if b.output_size is not None), None)
        out.append(
            Evidence(
                EvidenceKind.TARGETS_OUT_OF_RANGE,
                f"class targets in [{lo}, {hi}] at {_at(f, ranks, rows)}, the model has {size} outputs",
                {"rows": rows, "target_min": lo, "target_max": hi, "output_size": size},
            )
        )
    return out


def _cheap_cause(f: Findings) -> Diagnosis | None:
    if not f.state_ok:
        return _state_cause(f)
    if f.signal is Signal.LOSS_SCALE_COLLAPSE or f.signal in _SPIKES:
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            evidence=(Evidence(EvidenceKind.HISTORY_RISING, f.history.summary()),),
        )
    if f.signal is Signal.DIVERGING:
        return _diverging(f)
    evidence = _cheap_evidence(f)
    kinds = {e.kind: e for e in evidence}
    for kind, cause in (
        (EvidenceKind.BATCH_NONFINITE, Cause.INPUT_DATA),
        (EvidenceKind.TARGETS_NONFINITE, Cause.TARGETS),
        (EvidenceKind.TARGETS_OUT_OF_RANGE, Cause.TARGETS),
        (EvidenceKind.BATCH_MAGNITUDE, Cause.INPUT_DATA),
    ):
        # Under half precision a large-but-finite row may only overflow the half dtype: the replay decides.
        if kind is EvidenceKind.BATCH_MAGNITUDE and f.half_precision:
            continue
        if kind in kinds:
            attr = {
                EvidenceKind.BATCH_NONFINITE: "nonfinite_rows",
                EvidenceKind.TARGETS_NONFINITE: "nonfinite_target_rows",
                EvidenceKind.TARGETS_OUT_OF_RANGE: "target_rows",
                EvidenceKind.BATCH_MAGNITUDE: "magnitude_rows",
            }[kind]
            ranks, rows = _rows_by_rank(f, attr)
            return Diagnosis(
                cause,
                hint=TARGETS_NONFINITE_HINT if kind is EvidenceKind.TARGETS_NONFINITE else "",
                where=_at(f, ranks, rows),
                evidence=(kinds[kind], *(e for e in evidence if e is not kinds[kind])),
                ranks=ranks,
                rows=rows,
            )
    if f.scaler_overflow and f.history.loss_rising:
        # The overflows are the symptom: the loss itself was climbing into them.
        scale = f"{f.scale:g}" if f.scale is not None else "?"
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            where=f"gradients at loss scale {scale}, the loss climbing",
            evidence=(
                Evidence(EvidenceKind.HISTORY_RISING, f.history.summary()),
                Evidence(EvidenceKind.LOSS_SCALE, f"the scaled gradients overflowed at loss scale {scale}"),
            ),
        )
    if f.scaler_overflow:
        scale = f"{f.scale:g}" if f.scale is not None else "?"
        return Diagnosis(
            Cause.HALF_PRECISION_OVERFLOW,
            where=f"gradients at loss scale {scale}",
            evidence=(Evidence(EvidenceKind.LOSS_SCALE, f"the scaled gradients overflowed at loss scale {scale}"),),
            hint="routine for fp16 with a GradScaler: it dropped the update and lowered its scale",
        )
    return None


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def _times(value: float | None, reference: float | None) -> str:
    """``value`` as a multiple of ``reference`` (``"?"`` where no ratio means anything)."""
    if value is None or reference is None or reference <= 0 or not math.isfinite(value / reference):
        return "?"
    return f"{value / reference:.3g}x"


def _diverging(f: Findings) -> Diagnosis:
    """A snapshot was taken mid-divergence: finite, but its step's loss and grad norm far above the last sound one's.
    No batch is to blame (the event comes before this batch runs) and nothing needs a replay: the history is the
    evidence."""
    history = Evidence(EvidenceKind.HISTORY_RISING, f.history.summary())
    d = f.divergence
    if d is None:
        return Diagnosis(Cause.GRADIENT_EXPLOSION, where="a snapshot taken mid-divergence", evidence=(history,))
    at = "" if d.reference_step is None else f" (step {d.reference_step})"
    now, ref = d.health, d.reference
    where = (
        f"the snapshot of step {d.step}: loss {_num(now.loss)}, grad norm {_num(now.grad_norm)}, against "
        f"{_num(ref.loss)} and {_num(ref.grad_norm)} at the last sound snapshot{at}"
    )
    seen = Evidence(
        EvidenceKind.HISTORY_RISING,
        f"step {d.step}: loss {_times(now.loss, ref.loss)} and grad norm {_times(now.grad_norm, ref.grad_norm)} "
        f"those of the last sound snapshot{at}, more than {d.factor:g}x in both: the run is diverging while finite",
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


def _state_cause(f: Findings) -> Diagnosis:
    s = f.state
    names = s.names
    listed = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
    evidence = [Evidence(EvidenceKind.STATE_NONFINITE, f"non-finite: {listed}", {"tensors": names})]
    if f.resumed_from is not None and f.finite_steps == 0:
        evidence.append(
            Evidence(
                EvidenceKind.STATE_FROM_CHECKPOINT,
                f"no finite step since resuming from {f.resumed_from}",
                {"checkpoint": f.resumed_from},
            )
        )
        return Diagnosis(
            Cause.CORRUPT_STATE,
            where=f"{', '.join(names[:3])} (loaded from {f.resumed_from})",
            evidence=tuple(evidence),
            hint=f"the checkpoint {f.resumed_from} holds non-finite values: resume from an earlier one",
            state_tensors=names,
            state_damaged=True,
        )
    damaged = set(s.parameters)
    by_update = [n for n in s.update_nonfinite if n in damaged]
    if f.last_step_finite and s.parameters and (by_update or s.eps_underflow):
        if by_update:
            evidence.append(
                Evidence(
                    EvidenceKind.GRADS_FINITE_UPDATE_NOT,
                    f"the last step's gradients were finite, and the Adam update recomputed from its finite moments "
                    f"is non-finite for {', '.join(by_update[:3])}",
                    {"parameters": tuple(by_update)},
                )
            )
        for line in s.eps_underflow:
            evidence.append(Evidence(EvidenceKind.EPS_UNDERFLOW, line))
        return Diagnosis(
            Cause.OPTIMIZER_NUMERICS,
            where=f"the optimizer update of {', '.join((by_update or list(s.parameters))[:3])}",
            evidence=tuple(evidence),
            state_tensors=names,
            state_damaged=True,
        )
    where = ", ".join(names[:3])
    ranks: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    this_batch = False
    if s.buffers:
        # A forward pass writes buffers (BatchNorm statistics): the batch that ran it is the suspect.
        evidence.extend(_cheap_evidence(f))
        for attr in ("nonfinite_rows", "magnitude_rows"):
            ranks, rows = _rows_by_rank(f, attr)
            if rows:
                break
        owners = ", ".join(s.buffer_modules[:3])
        where = f"{', '.join(s.buffers[:3])}, written by the forward of {owners or 'the model'}"
        # This step's loss went non-finite while every parameter is finite: its own forward produced the values the
        # buffers folded in, so this batch is the suspect even when no row stands out (a uniformly bad shard).
        this_batch = f.signal in (Signal.NONFINITE_LOSS, Signal.NONFINITE_LOSS_AND_GRADS) and not s.parameters
        if rows:
            where += f" on {_at(f, ranks, rows)}"
        elif this_batch:
            where += f" on batch {f.batch_idx} (every row: none stands out)"
        if s.parameters:
            where += f"; also {', '.join(s.parameters[:3])}"
    return Diagnosis(
        Cause.CORRUPT_STATE,
        where=where,
        evidence=tuple(evidence),
        ranks=ranks,
        rows=rows,
        state_tensors=names,
        state_damaged=True,
        caused_by_data=bool(rows) or (bool(s.buffers) and this_batch),
    )


# ---------------------------------------------------------------------------------------------- replay evidence
def _reproduced(f: Findings) -> list[tuple[int, PassResult, PassResult | None]]:
    return [(r, p.hooked, p.fp32) for r, p in enumerate(f.replay) if p.hooked is not None and p.hooked.reproduced]


def _huge(p: PassResult) -> bool:
    return p.max_abs_grad >= HUGE_OUTPUT or p.max_abs_output >= HUGE_OUTPUT


def _range(p: PassResult) -> str:
    if p.input_min is None or p.input_max is None:
        return ""
    return f", its input in [{p.input_min:.4g}, {p.input_max:.4g}]"


def _replay_cause(f: Findings) -> Diagnosis | None:
    ran = [p for p in f.replay if p.hooked is not None]
    if not ran:
        return None
    errors = [p.hooked.error for p in ran if p.hooked is not None and p.hooked.error]
    if errors:
        return None
    hits = _reproduced(f)
    huge = [(r, p.hooked) for r, p in enumerate(f.replay) if p.hooked is not None and _huge(p.hooked)]
    if not hits and huge:
        # Everything finite, but so large that a norm or a square overflows (the step's grad norm did): divergence.
        rank, p = huge[0]
        on = f" on rank {rank}" if len(f.replay) > 1 else ""
        top = max(p.max_abs_grad, p.max_abs_output)
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            where=f"{p.max_abs_module or 'the model'}{on} (finite but huge: gradients up to {p.max_abs_grad:.3g}, "
            f"outputs up to {p.max_abs_output:.3g})",
            evidence=(
                Evidence(
                    EvidenceKind.REPLAY_FP32_NONFINITE,
                    f"the replay's values are finite but reach {top:.3g}: their squares overflow float32",
                    {"max_abs_grad": p.max_abs_grad, "max_abs_output": p.max_abs_output},
                ),
                Evidence(EvidenceKind.HISTORY_RISING, f.history.summary()),
            ),
            ranks=tuple(r for r, _ in huge),
            module=p.max_abs_module,
        )
    if not hits:
        return Diagnosis(
            Cause.TRANSIENT,
            where=f"batch {f.batch_idx} (not reproduced)",
            evidence=(
                Evidence(
                    EvidenceKind.REPLAY_NOT_REPRODUCED,
                    "the same batch on the same weights gave a finite loss, outputs and gradients on every rank",
                ),
            ),
        )
    ranks = tuple(r for r, _, _ in hits)
    rank, hooked, _ = hits[0]
    on = f" on rank {rank}" if len(f.replay) > 1 else ""
    if not hooked.loss_finite and hooked.outputs_finite and hooked.max_abs_output >= HUGE_OUTPUT:
        # Finite outputs so large that squaring them overflows: the model diverged, the loss only showed it.
        size = f"{hooked.max_abs_output:.3g}"
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            where=f"{hooked.max_abs_module}{on} (outputs up to {size}: the loss overflowed from their size)",
            evidence=(
                Evidence(
                    EvidenceKind.REPLAY_LOSS_ONLY,
                    f"every module output was finite but reached {size}, the loss was not finite",
                    {"max_abs_output": hooked.max_abs_output, "module": hooked.max_abs_module},
                ),
                Evidence(EvidenceKind.HISTORY_RISING, f.history.summary()),
            ),
            ranks=ranks,
            module=hooked.max_abs_module,
        )
    if not hooked.loss_finite and hooked.outputs_finite:
        return Diagnosis(
            Cause.LOSS_FUNCTION,
            where=f"the loss of training_step{on} (every module output finite)",
            evidence=(Evidence(EvidenceKind.REPLAY_LOSS_ONLY, "every module output was finite, the loss was not"),),
            ranks=ranks,
        )
    module = hooked.first_module or "?"
    inputs_bad = any(v is not None and not math.isfinite(v) for v in (hooked.input_min, hooked.input_max))
    child = module
    summary = f"the first non-finite {hooked.first_kind or 'value'} was {module}'s{on} ({hooked.dtype}){_range(hooked)}"
    if inputs_bad and hooked.first_kind == "output" and module != "?":
        # Its input was already non-finite: the overflow happened in the parent's own forward code (an op between
        # submodules, e.g. `self.proj(h * 300)`), so the parent is the module to name (and to run in float32).
        module = module.rsplit(".", 1)[0] if "." in module else ""
        summary = (
            f"the first non-finite output was {child}'s{on} ({hooked.dtype}), whose input was already non-finite"
            f"{_range(hooked)}: {module or 'the LightningModule'}'s own forward overflowed before calling it"
        )
    first = Evidence(
        EvidenceKind.REPLAY_FIRST_MODULE,
        summary,
        {
            "module": module,
            "first_kind": hooked.first_kind,
            "input_min": hooked.input_min,
            "input_max": hooked.input_max,
            "dtype": hooked.dtype,
            "rank": rank,
        },
    )
    fp32_results = [x for _, _, x in hits if x is not None]
    if f.half_precision and fp32_results and not any(x.reproduced for x in fp32_results):
        inside = f" (its own forward, before {child})" if child != module else ""
        return Diagnosis(
            Cause.HALF_PRECISION_OVERFLOW,
            where=f"{module or '<the LightningModule>'}{inside}{on} (finite in float32)",
            evidence=(
                first,
                Evidence(EvidenceKind.REPLAY_FP32_FINITE, "the same batch is finite in float32", {"module": module}),
            ),
            ranks=ranks,
            module=module,
        )
    if not f.half_precision or any(x.reproduced for x in fp32_results):
        again = "non-finite in float32 too" if f.half_precision else f"non-finite in {f.precision}"
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            where=f"{module}{on} ({again})",
            evidence=(
                first,
                Evidence(EvidenceKind.REPLAY_FP32_NONFINITE, f"the same batch is {again}"),
                Evidence(EvidenceKind.HISTORY_RISING, f.history.summary()),
            ),
            ranks=ranks,
            module=module,
        )
    # Half precision, reproduced, but no float32 pass (budget): the module, not the class.
    return Diagnosis(
        Cause.UNKNOWN,
        where=f"{module}{on}",
        evidence=(first,),
        ranks=ranks,
        module=module,
        note="no float32 replay to tell an overflow from a divergence",
    )


def _fallback(f: Findings) -> Diagnosis:
    errors = [p.hooked.error for p in f.replay if p.hooked is not None and p.hooked.error]
    note = f"replay failed: {errors[0]}" if errors else ""
    if f.history.rising:
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            evidence=(Evidence(EvidenceKind.HISTORY_RISING, f.history.summary()),),
            note=note,
        )
    skipped: tuple[Evidence, ...] = (Evidence(EvidenceKind.REPLAY_SKIPPED, f.note),) if f.note else ()
    return Diagnosis(Cause.UNKNOWN, evidence=skipped, note=note)


def replay_steps(ms: float, step_seconds: float) -> float | None:
    """``ms`` as a multiple of one training step (``None`` when the step time is unknown)."""
    if not math.isfinite(step_seconds) or step_seconds <= 0:
        return None
    return ms / (step_seconds * 1000.0)
