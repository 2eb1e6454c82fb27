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


def explain(row: dict[str, Any]) -> Finding | None:
    """The first known finding that explains a failing ``row``."""
    return next((f for f in FINDINGS if f.matches(row)), None)
