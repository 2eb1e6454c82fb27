"""What a diagnosis rests on: one event's findings, as plain values, and the evidence sentences read from them.

The engine gathers the cheap findings (the batch, the state, the history, the GradScaler) and forensics adds a
replay of the batch when they do not settle the cause; the evidence rules (``policies/rules/``) read them. Plain,
picklable values only: per-rank parts are gathered across ranks, so every rank decides alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_nanguard.contract import Divergence, Evidence, EvidenceKind, Signal
from lightning_nanguard.policies.origin import Origin
from lightning_nanguard.policies.probe import ProbeVerdict
from lightning_nanguard.signals.batch import BatchFindings
from lightning_nanguard.signals.history import HistoryFindings
from lightning_nanguard.signals.state import StateFindings

__all__ = [
    "HUGE_OUTPUT",
    "Findings",
    "Growth",
    "PassResult",
    "ReplayFindings",
    "at",
    "batch_evidence",
    "history_evidence",
    "rows_by_rank",
]

HUGE_OUTPUT = 1e15  # a finite activation this large is divergence (its square is within 1e8 of float32's max)


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
    origin: Origin | None = None  # the op and line that made the first non-finite value (a traced pass only)
    trace_note: str = ""  # why the origin trace stopped early ("" it did not, or no trace ran)
    index_fields: tuple[str, ...] = ()  # integer batch fields that index a parameter (they condition the model)


@dataclass(frozen=True)
class ReplayFindings:
    """One rank's replay: the pass in the training precision, then (maybe) the float32 one."""

    hooked: PassResult | None = None
    fp32: PassResult | None = None
    ms: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class Growth:
    """Parameters whose largest |value| grew more than ``factor`` x since the last sound snapshot (finite damage):
    ``(name, now, then)`` each, the largest growth first."""

    reference_step: int
    factor: float
    parameters: tuple[tuple[str, float, float], ...] = ()


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
    probe: ProbeVerdict | None = None  # a ``probe_rose`` event: the probe batch's loss before and after
    grown: Growth | None = None  # parameters grown by orders of magnitude since the last sound snapshot

    @property
    def replay_errors(self) -> list[str]:
        """The errors of the replay passes that raised (their one-line messages)."""
        return [p.hooked.error for p in self.replay if p.hooked is not None and p.hooked.error]


def rows_by_rank(f: Findings, attr: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks whose batch shows ``attr`` rows (a ``BatchFindings`` field), and those rows, merged."""
    ranks = tuple(r for r, b in enumerate(f.batch) if getattr(b, attr))
    rows = tuple(sorted({i for b in f.batch for i in getattr(b, attr)}))
    return ranks, rows


def at(f: Findings, ranks: tuple[int, ...], rows: tuple[int, ...]) -> str:
    """``"batch 3 rows [2, 5]"``, with the ranks first under DDP."""
    on = f"rank {', '.join(map(str, ranks))} " if len(f.batch) > 1 and ranks else ""
    return f"{on}batch {f.batch_idx} rows {list(rows)}"


def history_evidence(f: Findings) -> Evidence:
    """The recent history, as ``history_rising`` only where it was rising (``history`` otherwise)."""
    kind = EvidenceKind.HISTORY_RISING if f.history.rising else EvidenceKind.HISTORY
    return Evidence(kind, f.history.summary())


def batch_evidence(f: Findings) -> list[Evidence]:
    """What the batch itself shows: non-finite input rows, non-finite target rows, outsized rows, class targets out
    of range (``signals.batch.split_batch`` says which parts of a batch are targets)."""
    out: list[Evidence] = []
    ranks, rows = rows_by_rank(f, "nonfinite_rows")
    if rows:
        out.append(
            Evidence(EvidenceKind.BATCH_NONFINITE, f"NaN/inf in the inputs at {at(f, ranks, rows)}", {"rows": rows})
        )
    ranks, rows = rows_by_rank(f, "nonfinite_target_rows")
    if rows:
        out.append(
            Evidence(EvidenceKind.TARGETS_NONFINITE, f"NaN/inf in the targets at {at(f, ranks, rows)}", {"rows": rows})
        )
    ranks, rows = rows_by_rank(f, "magnitude_rows")
    if rows:
        top = max(b.max_abs for b in f.batch)
        median = max(b.median_row_abs for b in f.batch)
        out.append(
            Evidence(
                EvidenceKind.BATCH_MAGNITUDE,
                f"inputs up to {top:.3g} at {at(f, ranks, rows)}, against a median row of {median:.3g}",
                {"rows": rows, "max_abs": top, "median_row_abs": median},
            )
        )
    ranks, rows = rows_by_rank(f, "target_rows")
    if rows:
        lo = min(b.target_min for b in f.batch if b.target_min is not None)
        hi = max(b.target_max for b in f.batch if b.target_max is not None)
        size = next((b.output_size for b in f.batch if b.output_size is not None), None)
        out.append(
            Evidence(
                EvidenceKind.TARGETS_OUT_OF_RANGE,
                f"class targets in [{lo}, {hi}] at {at(f, ranks, rows)}, the model has {size} outputs",
                {"rows": rows, "target_min": lo, "target_max": hi, "output_size": size},
            )
        )
    return out
