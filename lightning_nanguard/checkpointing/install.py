"""Put CheckpointGuard's verifying IO on a Trainer's strategy, and clear what killed saves left behind."""

from __future__ import annotations

import os
from collections.abc import Callable

import lightning.pytorch as pl

from lightning_nanguard import _lightning_compat
from lightning_nanguard.checkpointing import sharded
from lightning_nanguard.checkpointing.events import CheckpointEvent
from lightning_nanguard.checkpointing.orphans import remove_orphans
from lightning_nanguard.checkpointing.tmp_files import remove_stale_tmp_files
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO
from lightning_nanguard.exceptions import UnsupportedSetupError

__all__ = ["install_verifying_io", "remove_killed_saves"]


def install_verifying_io(
    trainer: pl.Trainer,
    *,
    require_sidecar: bool,
    fallback: bool,
    tag_last_good: bool,
    listener: Callable[[CheckpointEvent], None],
) -> VerifyingCheckpointIO:
    """Wrap ``trainer.strategy.checkpoint_io`` in a ``VerifyingCheckpointIO`` (a second fit on the same Trainer
    reuses the one there, with these settings); under ModelParallelStrategy/FSDPStrategy also the strategy's own
    ``save_checkpoint``/``load_checkpoint``, which bypass ``checkpoint_io`` on load (and, as directories, on save).

    Raises:
        UnsupportedSetupError: the strategy writes through an ``AsyncCheckpointIO``.
    """
    io = trainer.strategy.checkpoint_io
    if isinstance(io, VerifyingCheckpointIO):
        io.listener = listener
        io.require_sidecar, io.fallback, io.tag_last_good = require_sidecar, fallback, tag_last_good
    else:
        if "AsyncCheckpointIO" in {cls.__name__ for cls in type(io).__mro__}:
            raise UnsupportedSetupError(
                "CheckpointGuard cannot checksum checkpoints written in the background by AsyncCheckpointIO: the file "
                "is not complete when save_checkpoint returns. Remove AsyncCheckpointIO from Trainer(plugins=...) "
                "or remove CheckpointGuard."
            )
        io = VerifyingCheckpointIO(
            io, require_sidecar=require_sidecar, fallback=fallback, tag_last_good=tag_last_good, listener=listener
        )
        trainer.strategy.checkpoint_io = io
    if {"ModelParallelStrategy", "FSDPStrategy"} & _lightning_compat.strategy_class_names(trainer):
        sharded.install(trainer, io)
    return io


def remove_killed_saves(trainer: pl.Trainer) -> None:
    """On global rank 0 (the only rank that writes checkpoints): remove the temporary files killed saves left in
    the directories of the Trainer's checkpoint callbacks, and what checkpoints the project deleted left there (their
    sidecars, a tag of their bytes: ``orphans.py``)."""
    if not trainer.is_global_zero:
        return
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath and os.path.isdir(str(dirpath)):
            remove_stale_tmp_files(str(dirpath))
            remove_orphans(str(dirpath))
