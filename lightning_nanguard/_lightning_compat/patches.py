"""Patches of Lightning objects' behaviour: instance attributes put back exactly, clipping around a dropped update,
the evaluation step's precision context, TensorBoard's file writer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Lightning is imported by whoever passes a Trainer; verifying a file needs torch alone
    import lightning.pytorch as pl

__all__ = [
    "EVAL_STEP_CONTEXT",
    "AttributePatches",
    "clipping_possible",
    "guard_clipping",
    "takes_dataloader_iter",
    "tensorboard_one_event",
]


# The precision plugin's context Lightning enters around each evaluation step (``strategy.validation_step`` /
# ``test_step``), by the LightningModule method it wraps.
EVAL_STEP_CONTEXT = {"validation_step": "val_step_context", "test_step": "test_step_context"}


def takes_dataloader_iter(step: Callable[..., Any]) -> bool:
    """The step is declared as ``step(dataloader_iter)``: it pulls its own batches (Lightning's signature check)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    return bool(is_param_in_hook_signature(step, "dataloader_iter", explicit=True))


class AttributePatches:
    """Instance-attribute patches of Lightning objects, undone by restoring exactly what was there before.

    Lightning installs ``torch.compile``-wrapped ``validation_step``/``test_step`` as instance attributes; restoring
    with ``del`` would silently drop them (un-compiling evaluation), so a previous instance attribute is re-assigned.
    Only an attribute that did not exist as an instance attribute before the patch is deleted.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, bool, Any]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        own = vars(obj)
        had = name in own
        self._saved.append((obj, name, had, own.get(name)))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self._saved:
            obj, name, had, previous = self._saved.pop()
            if had:
                setattr(obj, name, previous)
            elif name in vars(obj):
                delattr(obj, name)

    def __bool__(self) -> bool:
        return bool(self._saved)


def clipping_possible(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether Lightning can clip gradients in this fit: a ``gradient_clip_val`` is set, or the module overrides
    ``configure_gradient_clipping`` (which may clip with values of its own). Otherwise the precision plugin's
    ``clip_gradients`` is only ever called with ``clip_val=0`` and returns at once, dropped update or not."""
    from lightning.pytorch import LightningModule

    if trainer.gradient_clip_val:
        return True
    return type(pl_module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping


def guard_clipping(trainer: pl.Trainer, allowed: Callable[[], bool]) -> None:
    """Skip Lightning's gradient clipping for a step whose update nanguard dropped (``allowed()`` is False).

    Lightning clips after ``on_before_optimizer_step``; with every gradient set to None, ``clip_grad_value_`` raises
    on the empty list (and clipping would be pointless anyway). The precision plugin's ``clip_gradients`` is wrapped
    as an instance attribute (saved and re-assigned, never deleted); installing twice wraps once.
    """
    plugin = trainer.precision_plugin
    current = plugin.clip_gradients
    if getattr(current, "_nanguard_guarded", False):
        current._nanguard_allowed = allowed  # type: ignore[attr-defined]
        return

    def clip_gradients(*args: Any, **kwargs: Any) -> Any:
        if not clip_gradients._nanguard_allowed():  # type: ignore[attr-defined]
            return None
        return current(*args, **kwargs)

    clip_gradients._nanguard_guarded = True  # type: ignore[attr-defined]
    clip_gradients._nanguard_allowed = allowed  # type: ignore[attr-defined]
    plugin.clip_gradients = clip_gradients  # type: ignore[method-assign]


def tensorboard_one_event(logger: object, metrics: Mapping[str, float], step: int) -> bool:
    """Write ``metrics`` as one TensorBoard event of scalar values; False (nothing written) where that would not be
    exactly what ``logger.log_metrics`` writes: another logger, a subclass that overrides ``log_metrics``, a logger
    ``prefix``, or a writer other than torch's ``SummaryWriter`` (tensorboardX)."""
    from lightning.fabric.loggers.tensorboard import TensorBoardLogger

    if not isinstance(logger, TensorBoardLogger) or logger._prefix:
        return False
    if type(logger).log_metrics is not TensorBoardLogger.log_metrics:
        return False
    writer = logger.experiment
    if type(writer).__module__ != "torch.utils.tensorboard.writer":
        return False
    from tensorboard.compat.proto.summary_pb2 import Summary

    # What ``SummaryWriter.add_scalar`` puts in each of its events (``simple_value``, a float32), all in one.
    values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
    writer._get_file_writer().add_summary(Summary(value=values), step)
    return True
