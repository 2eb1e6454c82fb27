"""Restore weights and optimizer state from a checkpoint file mid-fit, with public strategy calls, loops untouched.

Lightning's own restore of a checkpoint mid-fit rewinds the loops and ends the epoch early (LIGHTNING_FACTS
section 6), so this loads the pieces one by one: model, optimizers, GradScaler (only downward).
Param-group hyperparameters (lr, eps, betas...) in the file are *not* used: the live ones are put back after the
load, so an LR/eps backoff made since the checkpoint survives (and no old betas come back with the optimizer
state). Schedulers are not rewound, as for the in-memory path.

The file is read here, with ``torch.load(weights_only=True)`` and the full verification (sidecar, finiteness), not
through the strategy's ``CheckpointIO``: nanguard chose this file, so nothing in it is unpickled beyond weights, and a
``CheckpointGuard(fallback=True)`` wrapper cannot swap in another file (possibly a later step) behind the caller's
back. A checkpoint of a step after the current ``global_step`` is refused, and so is one that is not the run's own
past (``checkpointing/lineage.py``: under CheckpointGuard each file records the runs it descends from; after a resume from
step 32, the step-40 file the abandoned first run wrote is not this run's past). The verdict is reduced across
ranks, so every rank loads or every rank raises. Buffers whose infinities are intended (a mask of -inf the module
builds itself) are checked for NaN only (``checkpointing/infinities.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.checkpointing.lineage import Lineage, lineage_of
from lightning_nanguard.checkpointing.sidecar import meta_of
from lightning_nanguard.checkpointing.verify import checkpoint_step, last_good_checkpoint, verify_and_load
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO
from lightning_nanguard.exceptions import CheckpointVerificationError

__all__ = [
    "DiskRestore",
    "has_rollback_checkpoint",
    "load_rollback_checkpoint",
    "restore_from_checkpoint",
    "rollback_checkpoint",
    "run_lineage",
]


@dataclass(frozen=True)
class DiskRestore:
    path: str
    step: int  # the checkpoint's global_step
    log_step: int  # its logging step (``_batches_that_stepped``), for the TensorBoard purge
    scale: float | None  # the GradScaler scale saved in the file (applied only downward by the caller)


def run_lineage(trainer: pl.Trainer) -> Lineage | None:
    """The fit's lineage, kept by CheckpointGuard's IO; ``None`` without CheckpointGuard (nothing is known)."""
    io = trainer.strategy.checkpoint_io
    return io.lineage if isinstance(io, VerifyingCheckpointIO) else None


def rollback_checkpoint(trainer: pl.Trainer, dirpath: str, *, at_or_before_step: int) -> str | None:
    """The checkpoint file a disk rollback to ``at_or_before_step`` takes from ``dirpath`` (rank-local: reads files,
    no collective): the newest that verifies, of that step or earlier, and the run's own past."""
    lineage = run_lineage(trainer)

    def admit(path: str, step: int) -> bool:
        return lineage is None or lineage.admits(lineage_of(meta_of(path)), step, at_or_before_step)

    module = trainer.lightning_module
    return last_good_checkpoint(
        dirpath, at_or_before_step=at_or_before_step, directories=False, module=module, admit=admit
    )


def load_rollback_checkpoint(
    path: str,
    *,
    at_or_before_step: int,
    require_sidecar: bool = True,
    module: torch.nn.Module | None = None,
    lineage: Lineage | None = None,
) -> dict[str, Any]:
    """Read and verify ``path`` for a rollback to ``at_or_before_step`` (weights-only); raise if it does not qualify.

    Args:
        module: the live module (its buffers say which infinities are intended).
        lineage: the run's lineage; a file it does not admit (another run's trajectory) is refused.

    Raises:
        CheckpointVerificationError: the file fails verification, is not a Lightning checkpoint, is of a later
            step, or is not the run's own past.
    """
    result, checkpoint = verify_and_load(
        path,
        require_sidecar=require_sidecar,
        load=lambda p: torch.load(p, map_location="cpu", weights_only=True),
        module=module,
    )
    if not result.ok:
        raise CheckpointVerificationError(
            f"nanguard: cannot roll back from {path}: {result.reason}. No weights were loaded from it."
        )
    step = checkpoint_step(checkpoint)
    if step is None:
        raise CheckpointVerificationError(
            f"nanguard: cannot roll back from {path}: not a Lightning checkpoint (no state_dict/global_step)."
        )
    if step > at_or_before_step:
        raise CheckpointVerificationError(
            f"nanguard: cannot roll back from {path}: it holds global_step={step}, after the step being restored to "
            f"({at_or_before_step}); it belongs to another (abandoned) run in the same directory."
        )
    if lineage is not None and not lineage.admits(lineage_of(meta_of(path)), step, at_or_before_step):
        raise CheckpointVerificationError(
            f"nanguard: cannot roll back from {path}: it is not this run's past (its sidecar records another run's "
            "trajectory, abandoned by this run's resume)."
        )
    return checkpoint


def has_rollback_checkpoint(trainer: pl.Trainer, dirpath: str | None, *, at_or_before_step: int) -> bool:
    """A verified checkpoint file of a step at or before ``at_or_before_step`` is in ``dirpath``. Rank 0 looks at the
    files and broadcasts (a collective: call on every rank, on the incident path only). Files only, as
    ``restore_from_checkpoint`` loads them (not a distributed checkpoint directory)."""
    found = (
        dirpath is not None
        and trainer.is_global_zero
        and rollback_checkpoint(trainer, dirpath, at_or_before_step=at_or_before_step)
    )
    return bool(_distributed.broadcast_object(trainer, bool(found)))


def restore_from_checkpoint(trainer: pl.Trainer, path: str) -> DiskRestore:
    """Load ``path``'s model and optimizer state into the running fit. Call on every rank, with the same ``path``.

    Raises:
        CheckpointVerificationError: on every rank, when the file fails verification on any rank or is of a step
            after ``trainer.global_step`` (nothing is loaded then).
    """
    strategy = trainer.strategy
    error: CheckpointVerificationError | None = None
    checkpoint: dict[str, Any] = {}
    try:
        checkpoint = load_rollback_checkpoint(
            path,
            at_or_before_step=int(trainer.global_step),
            module=trainer.lightning_module,
            lineage=run_lineage(trainer),
        )
    except CheckpointVerificationError as err:
        error = err
    if _distributed.any_rank(trainer, error is not None):  # every rank loads, or none does
        raise error or CheckpointVerificationError(
            f"nanguard: cannot roll back from {path}: it failed verification on another rank (rank "
            f"{trainer.global_rank} read it fine); every rank must read the same file (a shared filesystem)."
        )
    hyper = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in trainer.optimizers]
    strategy.load_model_state_dict(checkpoint, strict=True)
    if checkpoint.get("optimizer_states"):
        strategy.load_optimizer_state_dict(checkpoint)
    for opt, groups in zip(trainer.optimizers, hyper, strict=True):
        for group, saved in zip(opt.param_groups, groups, strict=True):
            group.update(saved)
    step = int(checkpoint.get("global_step", 0))
    log_step = _lightning_compat.checkpoint_log_step(checkpoint, default=step)
    scale = _lightning_compat.checkpoint_scaler_scale(checkpoint, trainer)
    return DiskRestore(path=path, step=step, log_step=log_step, scale=scale)
