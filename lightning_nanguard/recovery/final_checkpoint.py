"""Write a checkpoint of the (restored, finite) state before a graceful stop, with its checksum sidecar."""

from __future__ import annotations

import os

import lightning.pytorch as pl

from lightning_nanguard.checkpoints import write_sidecar

__all__ = ["checkpoint_dir", "save_verified_checkpoint"]


def checkpoint_dir(trainer: pl.Trainer, explicit: str | None) -> str | None:
    """The run's checkpoint directory: ModelCheckpoint's ``dirpath`` if one is configured, else ``explicit``."""
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return str(dirpath) if dirpath else explicit


def save_verified_checkpoint(trainer: pl.Trainer, dirpath: str, name: str) -> str:
    """``trainer.save_checkpoint`` on every rank (it holds a barrier), then the sha256 sidecar on rank 0."""
    path = os.path.join(dirpath, name)
    trainer.save_checkpoint(path)
    if trainer.is_global_zero:
        write_sidecar(path)
    trainer.strategy.barrier("nanguard_final_checkpoint")
    return path
