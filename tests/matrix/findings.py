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
        key="lone-observer-returns-nonfinite",
        title="CheckpointGuard or FP32Evaluation alone: fit returns normally with NaN/inf weights",
        matches=lambda r: (
            r["callbacks"] in ("CheckpointGuard", "FP32Evaluation") and r["outcome"] == "nonfinite_return"
        ),
        what=(
            "With no callback that drives the engine (GradNormMonitor, AutoRollback, OptimizerBackoff or "
            "LossScaleWatchdog), these two end the fit with `Engine.finish(raise_pending=True)` but never run "
            "`final_check`, so the end-of-fit state check (the package's promise: a normal return means finite "
            "parameters and buffers) is skipped. CheckpointGuard even refuses the NaN saves (one `refuse` incident "
            "each) and still lets `fit` return the NaN model; FP32Evaluation records nothing."
        ),
        fix=(
            "`lightning_nanguard/callbacks/checkpoint_guard.py` `on_train_end` and "
            "`lightning_nanguard/callbacks/fp32_evaluation.py` `on_train_end`: when no member drives the engine, call "
            "`Engine.train_end` (which runs `engine/incidents.py:final_check`, then `finish`) instead of "
            "`Engine.finish`; or make `Engine.finish(raise_pending=True)` run `final_check` once itself."
        ),
    ),
    Finding(
        key="buffer-nan-seen-late",
        title="A non-finite BatchNorm buffer: seen only at checkpoint saves and at the end of fit (incidents != faults)",
        matches=lambda r: r["site"] == "buffer" and _incidents_mismatch(r),
        what=(
            "A NaN/inf written into `running_mean` leaves the loss and gradients finite (training-mode BatchNorm uses "
            "the batch's statistics), so no step check fires. CheckpointGuard refuses every later save (one "
            "`refuse` incident each: 3 for 12 steps with saves every 4, 5 under manual optimization where "
            "`global_step` counts both optimizers), and only `final_check` at the end of fit repairs it, rolling "
            "back to the last snapshot (step 0 with the preset's `every_n_steps=50`): every update since is lost. "
            "One fault, 4 to 6 incidents; a recurring fault (9 injections), the same 4 to 6."
        ),
        fix=(
            "`lightning_nanguard/callbacks/checkpoint_guard.py` (the `refused_save` event, around line 217): a save "
            "refused for non-finite parameters/buffers is evidence of corrupt state; hand it to the engine's "
            "corrupt-state path (`engine/incidents.py`, the `NONFINITE_STATE` rollback that `final_check` already "
            "does) at that step, as one incident, instead of recording a refusal per save and repairing only at the "
            "end. Optionally a cheap buffers-only finiteness check at each optimizer step (`engine/state_check.py`)."
        ),
    ),
    Finding(
        key="one-rank-param-desync-unseen",
        title="DDP: a finite change to one rank's parameters splits the ranks, and nothing notices",
        matches=lambda r: bool(r.get("diverged")),
        what=(
            "A spike (x1e4) written into one rank's parameter at a step start is finite, so no step check fires "
            "(the preset leaves spike detection off, and a lone FP32Evaluation, CheckpointGuard or OptimizerBackoff "
            "watches no step). DDP all-reduces gradients but never re-broadcasts parameters, so the ranks train on "
            "different weights from then on and the fit returns with rank 0's copy while the others differ; a "
            "non-finite value on one rank's parameters is caught by the step checks (the loss goes non-finite)."
        ),
        fix=(
            "A cross-rank parameter agreement check where a collective is already paid for: at AutoRollback's "
            "snapshot (`lightning_nanguard/recovery/snapshot.py` `take`, through `lightning_nanguard/_distributed.py`) "
            "all-reduce one checksum of the parameters (min and max of a float64 sum) and treat a mismatch as "
            "corrupt state on the ranks that differ (restore or raise); and at the end of fit in "
            "`engine/incidents.py:final_check`, which already runs a collective."
        ),
    ),
]


def explain(row: dict[str, Any]) -> Finding | None:
    """The first known finding that explains a failing ``row``."""
    return next((f for f in FINDINGS if f.matches(row)), None)
