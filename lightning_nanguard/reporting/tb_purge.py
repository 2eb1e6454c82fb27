"""Make TensorBoard forget the steps a rollback abandoned: a ``SessionLog.START`` event at the restored step.

TensorBoard's event reader (``purge_orphaned_data=True``, its default) drops every scalar, histogram and tensor
with ``step >= s`` that was written *before* a START event at step ``s``, but only in a run that already has a START
event; so one is written at fit start and one per rollback. This is what BigScience did by hand for BLOOM by
deleting event files. Lightning's logging step keeps increasing after a rollback, so the steps logged afterwards are
larger than the purge step and survive.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["write_session_start"]


@rank_zero_only
def write_session_start(trainer: pl.Trainer, step: int) -> bool:
    """Write a START event at ``step`` to every TensorBoardLogger (rank 0). True if one was written."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    written = False
    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        writer = logger.experiment
        file_writer = writer._get_file_writer() if hasattr(writer, "_get_file_writer") else writer.file_writer
        if file_writer is None:
            continue
        event = Event(step=int(step), wall_time=time.time(), session_log=SessionLog(status=SessionLog.START))
        file_writer.add_event(event)
        written = True
    return written
