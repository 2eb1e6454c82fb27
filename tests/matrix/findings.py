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
        key="buffer-nan-seen-at-saves-only",
        title=(
            "A non-finite BatchNorm buffer is seen only when a checkpoint is saved (or at the end of fit): a recurring "
            "buffer fault gives fewer incidents than faults"
        ),
        matches=lambda r: r["site"] == "buffer" and _incidents_mismatch(r),
        what=(
            "A NaN/inf written into `running_mean` leaves the loss and the gradients finite (training-mode BatchNorm "
            "normalises with the batch's statistics), so no step check fires. The corrupt state is found when "
            "CheckpointGuard checks a save (every 4 steps here) or by the end-of-fit check, and repaired by one "
            "rollback each time (`corrupt_state`, `rollback`): a one-off fault gives one incident (correct), a fault "
            "at every step from 3 to 11 gives 3 (steps 4, 8, 12; 5 under manual optimization, whose `global_step` "
            "counts both optimizers). Between two checks the buffer stays non-finite, and without checkpointing the "
            "first check is the end of fit, whose rollback discards every update since the last snapshot."
        ),
        fix=(
            "Check the buffers at every optimizer step, not only at saves: fold `named_buffers()` into the step's "
            "fused finiteness pass (`lightning_nanguard/engine/sensing.py`, the sensor; `engine/state_check.py` "
            "has the buffer walk) so that a corrupt buffer is an incident at the step it appears; BatchNorm "
            "statistics are a few floats per channel, so the cost is negligible."
        ),
    ),
    Finding(
        key="one-rank-desync-unseen",
        title="DDP: a finite change on one rank (a parameter, or a gradient after the all-reduce) splits the ranks",
        matches=lambda r: bool(r.get("diverged")) and r["value"] == "spike",
        what=(
            "A spike (x1e4) written into one rank's parameter at a step start, or into one rank's gradient after "
            "DDP's all-reduce, is finite, so no step check fires (the preset leaves spike detection off; a lone "
            "FP32Evaluation, CheckpointGuard or OptimizerBackoff watches no step at all, nor does "
            "LossScaleWatchdog outside 16-mixed). "
            "DDP never re-broadcasts parameters, so the ranks train on different weights from then on and `fit` "
            "returns normally with rank 0's copy while the other ranks differ. Non-finite faults with the suite are "
            "caught (their reading is rank-reduced) and the ranks stay identical."
        ),
        fix=(
            "A cross-rank agreement check where a collective is already paid for: at AutoRollback's snapshot "
            "(`lightning_nanguard/recovery/snapshot.py` `take`) and in the end-of-fit check "
            "(`engine/incidents.py:final_check`), all-reduce one float64 checksum of the parameters (min and max, "
            "through `lightning_nanguard/_distributed.py`) and treat a mismatch as corrupt state (restore every "
            "rank from the same snapshot, or raise); optionally broadcast rank 0's parameters after a restore."
        ),
    ),
    Finding(
        key="fp16-ddp-scaler-split-without-step-watcher",
        title=(
            "16-mixed DDP with no step-watching callback (OptimizerBackoff alone): a NaN/inf gradient on one rank "
            "makes only that rank's GradScaler skip"
        ),
        matches=lambda r: bool(r.get("diverged")) and r["value"] != "spike",
        what=(
            "The gradient fault lands after DDP's all-reduce on one rank. The suite makes every rank's GradScaler "
            "drop the step together (`Engine.before_optimizer_step` ORs the rank-reduced verdict into each "
            "scaler's `found_inf`), but that code runs only when a member monitors steps: with OptimizerBackoff "
            "alone it returns at once, so the faulty rank's scaler skips and backs off while the other steps, and "
            "`fit` returns finite weights that differ across ranks (issue 12's fp16-DDP divergence, still open "
            "for this configuration)."
        ),
        fix=(
            "`lightning_nanguard/engine/engine.py` `before_optimizer_step`: under DDP with a GradScaler, do the "
            "scaler agreement (one all-reduce of the scaler's `found_inf`, through `_lightning_compat."
            "or_into_found_inf` and `_distributed`) even when `monitors_steps` is False."
        ),
    ),
]


def explain(row: dict[str, Any]) -> Finding | None:
    """The first known finding that explains a failing ``row``."""
    return next((f for f in FINDINGS if f.matches(row)), None)
