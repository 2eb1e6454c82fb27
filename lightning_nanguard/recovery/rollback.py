"""Carry out a rollback decision: restore from the snapshot ring, else from the newest verified checkpoint.

Every function here is called on every rank with identical arguments (snapshots are taken on the same steps on all
ranks, because every decision is reduced), and does the same collectives on every rank.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.exceptions import CheckpointVerificationError
from lightning_nanguard.policies.rollback import RollbackDecision, choose_sound
from lightning_nanguard.recovery.disk_restore import restore_from_checkpoint, rollback_checkpoint
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.signals.sharded import local_tensor

__all__ = ["Restored", "keep_lower_scale", "repair_buffers", "restore_state"]


@dataclass(frozen=True)
class Restored:
    step: int  # global_step of the restored state
    log_step: int  # its logging step
    source: str  # "memory" or "disk"
    path: str = ""  # the checkpoint, for "disk"
    passed_over: tuple[int, ...] = ()  # newer snapshots not restored: taken mid-divergence (newest first)


def restore_state(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    ring: SnapshotRing,
    decision: RollbackDecision,
    dirpath: str | None,
    *,
    at_or_before_step: int | None = None,
    unsound: Collection[int] = (),
) -> Restored | None:
    """Memory first (the snapshot the policy picks), then disk; on a recurrence with nothing older anywhere, the
    newest snapshot again (still better than the bad state). ``None`` when there is nothing to restore.

    Args:
        at_or_before_step: a checkpoint from disk must be of this step or earlier (never "restore" a step from an
            abandoned run's future).
        unsound: snapshot steps judged taken mid-divergence: passed over while a sound one is left in the ring.
    """
    restored = _from_ring(trainer, pl_module, ring, decision, unsound)
    if restored is None:
        ring.sync()  # a snapshot copy still reading the live state finishes before the checkpoint overwrites it
        restored = _from_disk(trainer, dirpath, at_or_before_step)
    if restored is None and decision.older_than is not None:
        restored = _from_ring(trainer, pl_module, ring, replace(decision, older_than=None), unsound)
    return restored


@torch.no_grad()
def repair_buffers(ring: SnapshotRing, module: nn.Module, names: Collection[str]) -> Restored | None:
    """Copy the named buffers (and only those) back from the newest snapshot: the parameters and the optimizer state
    stay as they are (they were found finite, so the last sound state of theirs is now). ``None`` when no snapshot
    holds them as they are now (then a full restore is the way). Buffers are kept whole by every rank (never spread
    over the DDP ranks), so this is no collective."""
    ring.sync()
    snap = ring.get(max(ring.steps(), default=-1))
    if snap is None or snap.layout is None:
        return None
    n_params = sum(1 for _ in module.parameters())
    at = {name: n_params + i for i, (name, _) in enumerate(module.named_buffers())}
    live = dict(module.named_buffers())
    if not names or any(n not in at or at[n] >= snap.n_model for n in names):
        return None
    pairs = [(local_tensor(live[n]), snap.view(at[n])) for n in names]
    if any(dst.shape != src.shape or dst.dtype != src.dtype for dst, src in pairs):
        return None
    for dst, src in pairs:
        dst.copy_(src)
    return Restored(snap.step, snap.log_step, "memory")


def keep_lower_scale(trainer: pl.Trainer, scale: float | None) -> None:
    """Lower the GradScaler's scale to ``scale`` if that is lower; never raise it (the backoff was earned)."""
    scaler = _lightning_compat.get_scaler(trainer)
    if scale is not None and scaler is not None and scaler.is_enabled() and scale < float(scaler.get_scale()):
        scaler.update(new_scale=scale)


def _from_ring(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    ring: SnapshotRing,
    decision: RollbackDecision,
    unsound: Collection[int],
) -> Restored | None:
    while True:
        chosen, passed_over = choose_sound(decision, ring.steps(), unsound)
        snap = None if chosen is None else ring.get(chosen)
        if snap is None:
            return None
        # Parameters were verified when the snapshot was taken; the optimizer state is verified now (rare path), by
        # each rank for what it keeps (its chunk, under DDP), and whether the snapshot can restore the module as it is
        # now (a parameter materialized after it cannot be rolled back to it: ``snapshot_match``), in one reduction.
        unusable = ~ring.state_finite(snap) | (ring.mismatch(snap, pl_module, trainer.optimizers) is not None)
        if not _distributed.any_rank(trainer, unusable):
            break
        ring.discard(snap)
    ring.restore(snap, pl_module, trainer.optimizers, trainer)
    ring.discard_newer(snap.step)  # they belong to the trajectory that just went bad
    keep_lower_scale(trainer, snap.scale)
    return Restored(snap.step, snap.log_step, "memory", passed_over=passed_over)


def _from_disk(trainer: pl.Trainer, dirpath: str | None, at_or_before_step: int | None) -> Restored | None:
    step = int(trainer.global_step) if at_or_before_step is None else at_or_before_step
    local = (
        # Files only, of the run's own past (``disk_restore.rollback_checkpoint``).
        rollback_checkpoint(trainer, dirpath, at_or_before_step=step)
        if dirpath is not None and trainer.is_global_zero
        else None
    )
    path = _distributed.broadcast_object(trainer, local)  # every rank loads the same file
    if not isinstance(path, str):
        return None
    try:
        done = restore_from_checkpoint(trainer, path)
    except CheckpointVerificationError:
        return None  # every rank raised together (the outcome is agreed across ranks): nothing restored
    keep_lower_scale(trainer, done.scale)
    return Restored(done.step, done.log_step, "disk", path)
