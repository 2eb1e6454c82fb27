"""Writing to the Trainer's loggers from any hook: scalars, TensorBoard text and histograms. Rank 0 only."""

from __future__ import annotations

from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from lightning_nanguard._lightning_compat import log_step, tensorboard_one_event

__all__ = ["log_event", "log_histogram", "log_text"]


@rank_zero_only
def log_event(trainer: pl.Trainer, metrics: Mapping[str, float], step: int | None = None) -> None:
    """Send ``metrics`` to every configured logger at Lightning's logging step (the one ``self.log`` uses).

    A plain ``TensorBoardLogger`` gets them as ONE event holding every scalar
    (``_lightning_compat.tensorboard_one_event``), what ``log_metrics`` writes as one event per key: the same scalars
    at the same step for TensorBoard, for a fraction of the host time (docs/PERFORMANCE.md). Every other logger gets
    ``log_metrics``.
    """
    if not metrics:
        return
    at = log_step(trainer) if step is None else step
    for logger in trainer.loggers:
        if not tensorboard_one_event(logger, metrics, at):
            logger.log_metrics(metrics=dict(metrics), step=at)  # by keyword, as Lightning calls it


@rank_zero_only
def log_text(trainer: pl.Trainer, tag: str, text: str, step: int | None = None) -> None:
    """A TensorBoard text entry, when a TensorBoardLogger is configured."""
    at = log_step(trainer) if step is None else step
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=at)


@rank_zero_only
def log_histogram(trainer: pl.Trainer, tag: str, values: Tensor, step: int | None = None) -> None:
    """A TensorBoard histogram, when a TensorBoardLogger is configured."""
    at = log_step(trainer) if step is None else step
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_histogram(tag, values.detach().float().cpu(), global_step=at)
