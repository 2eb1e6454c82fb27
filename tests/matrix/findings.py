"""Known defects behind the matrix's failing cases: how to recognise each row, what happens, where a fix belongs.

The report groups every failing case under the first finding that matches it; a failing case no finding matches is
listed as unexplained (a new defect, or a change in behaviour to look at).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FINDINGS", "Finding", "explain"]


@dataclass(frozen=True)
class Finding:
    key: str
    title: str
    matches: Callable[[dict[str, Any]], bool]
    what: str
    fix: str


def _incidents_mismatch(row: dict[str, Any]) -> bool:
    return any(v.startswith("incidents (") for v in row["violations"])


FINDINGS: list[Finding] = [
    Finding(
        key="fp16-ddp-scaler-split-without-step-watcher",
        title=(
            "16-mixed DDP with only FP32Evaluation or CheckpointGuard (members that never touch a training step): a "
            "NaN/inf gradient on one rank makes only that rank's GradScaler skip, and the fit ends with "
            "RankDivergenceError"
        ),
        matches=lambda r: bool(r.get("diverged")) and r["value"] != "spike" and r["outcome"] == "finite",
        what=(
            "The gradient fault lands after DDP's all-reduce on one rank. Whenever a member drives the engine "
            "(GradNormMonitor, AutoRollback, OptimizerBackoff, LossScaleWatchdog) every rank's GradScaler drops the "
            "step together: the sensor's reduced verdict, or, when no member senses steps (OptimizerBackoff alone), "
            "one all-reduce of the scalers' `found_inf` (`engine/scaler_agreement.agree_scaler_skip`). FP32Evaluation and "
            "CheckpointGuard join without driving (no per-step hook), so with only them installed a rank-local fault "
            "splits the scalers as in plain Lightning; the end-of-fit check compares the ranks' parameters and "
            "raises `RankDivergenceError` (a documented error, not a violation). A row here would be a divergence "
            "that the end-of-fit check missed."
        ),
        fix="A divergence the end-of-fit check missed: `engine/state_check.py` `state_verdict`.",
    ),
]


def _quarantined_gap(row: dict[str, Any]) -> bool:
    return (
        row.get("model") == "iterable"
        and row["site"] == "input"
        and row["recurrence"] == "recurring"
        and row["precision"] == "16-mixed"
        and _incidents_mismatch(row)
        and (row.get("incidents") or 0) < (row.get("faults") or 0)
    )


FINDINGS.append(
    Finding(
        key="fingerprint-quarantined-batch-buffer-unchecked-16-mixed",
        title=(
            "16-mixed, IterableDataset, a NaN input at every step: the batches quarantined by fingerprint are dropped "
            "without an incident while the BatchNorm statistics their forward poisoned wait for the next guarded save"
        ),
        matches=_quarantined_gap,
        what=(
            "An `IterableDataset` has no sample indices, so the first bad batch is quarantined by its fingerprint. "
            "Every later batch of this recurring fault is all-NaN too and has the same fingerprint (its sums are "
            "NaN), so it comes back as that quarantined batch: its update is dropped without a new incident (the "
            "summary counts the dropped updates). Its forward still writes NaN into the BatchNorm's running "
            "statistics. Under 32-true, bf16-mixed and 16-true the step's buffer probe sees them at once (an "
            "incident and a rollback per step, as many as faults); under 16-mixed (the GradScaler's device path) the "
            "quarantined step's probe is not judged, and the poisoned statistics are found by CheckpointGuard's "
            "state check at the next save (every 4 steps here), which rolls them back. The fit ends finite; fewer "
            "incidents than faults."
        ),
        fix=(
            "`engine/step.py` (the quarantined batch's drop on the device path: judge the buffer probe of the step "
            "too), or `recovery/quarantine.py` (a fingerprint that is all NaN identifies no batch)."
        ),
    )
)


def explain(row: dict[str, Any]) -> Finding | None:
    """The first known finding that explains a failing ``row``."""
    return next((f for f in FINDINGS if f.matches(row)), None)
