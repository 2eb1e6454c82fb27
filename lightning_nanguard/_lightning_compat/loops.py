"""Lightning's loops: the logging step, the batch index, the logging interval, the training DataLoaders."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Lightning is imported by whoever passes a Trainer; verifying a file needs torch alone
    import lightning.pytorch as pl

__all__ = [
    "LoggingSteps",
    "is_train_logging_step",
    "log_step",
    "should_update_logs",
    "train_batch_idx",
    "train_loaders",
]


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own ``self.log`` writes at (``_batches_that_stepped``); fallback ``global_step``."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def train_batch_idx(trainer: pl.Trainer) -> int:
    """The index of the training batch in its epoch (the fit loop's counter); ``-1`` outside training."""
    return int(trainer.fit_loop.epoch_loop.batch_idx) if trainer.training else -1


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether this training step is a logging step, exactly as Lightning's LearningRateMonitor decides it."""
    connector = getattr(trainer, "_logger_connector", None)
    try:
        return bool(connector.should_update_logs)  # type: ignore[union-attr]
    except (AttributeError, NotImplementedError):
        n = int(getattr(trainer, "log_every_n_steps", 50))
        return n > 0 and ((log_step(trainer) + 1) % n == 0 or trainer.should_stop)


def is_train_logging_step(trainer: pl.Trainer) -> bool:
    """``should_update_logs`` from a training batch hook, computed as Lightning does it there (its fit-loop branch)
    without the property's loop dispatch: called every step."""
    n = getattr(trainer, "log_every_n_steps", 50)
    if not n:
        return False
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    stepped = getattr(loop, "_batches_that_stepped", None)
    if not isinstance(stepped, int):
        return should_update_logs(trainer)
    return (stepped + 1) % n == 0 or trainer.should_stop


class LoggingSteps:
    """``is_train_logging_step`` for one fit, with the fit loop's counter found once (at the start of training):
    ``due(trainer)`` is then one attribute read and a modulo per step. Falls back to ``is_train_logging_step``
    where the counter is not Lightning's."""

    __slots__ = ("every", "loop")

    def __init__(self, trainer: pl.Trainer) -> None:
        self.every = getattr(trainer, "log_every_n_steps", 50)
        loop = getattr(trainer.fit_loop, "epoch_loop", None)
        self.loop = loop if isinstance(getattr(loop, "_batches_that_stepped", None), int) else None

    def due(self, trainer: pl.Trainer) -> bool:
        loop = self.loop
        if loop is None:
            return is_train_logging_step(trainer)
        every = self.every
        return bool(every) and ((loop._batches_that_stepped + 1) % every == 0 or trainer.should_stop)


def train_loaders(trainer: pl.Trainer) -> list[tuple[tuple[Any, ...], Any]]:
    """The running fit's training iterables with the path of each in the batch Lightning builds from them: ``()`` for
    a single DataLoader (the batch is its batch), ``("a",)`` for ``{"a": loader, ...}``, ``(1,)`` for a list's second
    one. Empty before the fit's CombinedLoader exists."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    flattened = getattr(combined, "flattened", None) or []
    paths: dict[int, tuple[Any, ...]] = {}

    def walk(node: object, path: tuple[Any, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, key))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, (*path, i))
        else:
            paths.setdefault(id(node), path)

    walk(getattr(combined, "iterables", None), ())
    return [(paths.get(id(loader), (i,)), loader) for i, loader in enumerate(flattened)]
