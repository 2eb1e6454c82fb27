"""Write a checkpoint of the (restored, finite) state before a graceful stop, with its checksum sidecar."""

from __future__ import annotations

import contextlib
import os

import lightning.pytorch as pl

from lightning_nanguard import _distributed
from lightning_nanguard.checkpointing.verify import SIDECAR_SUFFIX, verify_checkpoint, write_sidecar
from lightning_nanguard.exceptions import UnsupportedSetupError

__all__ = ["checkpoint_dir", "require_checkpoint_dir", "save_final_checkpoint", "save_verified_checkpoint"]


def checkpoint_dir(trainer: pl.Trainer, explicit: str | None) -> str | None:
    """The run's checkpoint directory: ModelCheckpoint's ``dirpath`` if one is configured, else ``explicit``."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return str(dirpath) if dirpath else explicit


def require_checkpoint_dir(trainer: pl.Trainer, explicit: str | None, owner: str) -> str:
    """``checkpoint_dir``, or ``UnsupportedSetupError`` naming ``owner`` when the run has none.

    Raises:
        UnsupportedSetupError: no ModelCheckpoint with a ``dirpath`` and no ``explicit`` directory.
    """
    dirpath = checkpoint_dir(trainer, explicit)
    if dirpath is None:
        raise UnsupportedSetupError(
            f"{owner} needs a checkpoint directory: configure a ModelCheckpoint with a dirpath "
            "or pass AutoRollback(checkpoint_dir=...)."
        )
    return dirpath


def save_verified_checkpoint(trainer: pl.Trainer, dirpath: str, name: str) -> str:
    """``trainer.save_checkpoint`` on every rank (it holds a barrier), then verification and the sidecar on rank 0.

    Returns the path on every rank, or ``""`` on every rank when the file could not be written or does not verify
    (a CheckpointGuard refused it, or its weights are non-finite): a file that is not good is never blessed with a
    sidecar, and is removed so that no later resume takes it. The outcome is reduced across ranks.
    """
    path = os.path.join(dirpath, name)
    trainer.save_checkpoint(path)
    failed = False
    if trainer.is_global_zero:
        if os.path.isdir(path):
            # A distributed checkpoint (ModelParallelStrategy): CheckpointGuard's manifest verifies it; without one
            # it is not verified, and not blessed.
            failed = not verify_checkpoint(path).ok
        elif not os.path.isfile(path):
            failed = True  # refused by a CheckpointGuard (non-finite state): nothing was written
        elif os.path.isfile(path + SIDECAR_SUFFIX):
            failed = not verify_checkpoint(path).ok  # written by a CheckpointGuard, which wrote the sidecar too
        else:
            # No record of intended infinities: only the module's own buffers (a mask) may hold them, never a parameter.
            failed = not verify_checkpoint(path, require_sidecar=False, module=trainer.lightning_module).ok
            if failed:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            else:
                write_sidecar(path)
    if _distributed.any_rank(trainer, failed):  # also the barrier: rank 0 has finished writing
        return ""
    return path


def save_final_checkpoint(trainer: pl.Trainer, explicit_dir: str | None, step: int) -> str:
    """``save_verified_checkpoint`` of ``nanguard-final-step=<step>.ckpt`` into the run's checkpoint directory
    (``checkpoint_dir``, else ``<default_root_dir>/checkpoints``). Every rank calls it."""
    dirpath = checkpoint_dir(trainer, explicit_dir) or os.path.join(trainer.default_root_dir, "checkpoints")
    return save_verified_checkpoint(trainer, dirpath, f"nanguard-final-step={step}.ckpt")
