"""Every private or version-specific touch of Lightning/torch internals lives here, each with its public fallback.

``tests/test_fences.py`` holds the fence: a private attribute of a Lightning or torch object read or written
anywhere else fails it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

__all__ = [
    "EVAL_STEP_CONTEXT",
    "AttributePatches",
    "LoggingSteps",
    "accepts_found_inf",
    "active_scaler",
    "agree_scaler_skip",
    "batch_counter",
    "checkpoint_log_step",
    "checkpoint_scaler_scale",
    "clamp_scale",
    "clear_found_inf",
    "clear_found_inf_of",
    "clipping_possible",
    "current_scale",
    "foreach_norm",
    "foreach_norms",
    "fsdp1_state_dict_type",
    "get_scaler",
    "guard_clipping",
    "host_buffer_marked",
    "instance_attribute",
    "is_train_logging_step",
    "local_shards",
    "log_step",
    "optimizer_handles_unscaling",
    "or_into_found_inf",
    "or_nonfinite_into_found_inf",
    "saves_distributed_checkpoint",
    "scale_tensor",
    "scaler_state",
    "set_found_inf",
    "set_found_inf_where_nonfinite",
    "should_update_logs",
    "strategy_class_names",
    "takes_dataloader_iter",
    "tensorboard_one_event",
    "train_batch_idx",
    "train_batch_samplers",
    "tree_map",
    "true_flag",
]

# torch's fused per-tensor norms: one kernel per (device, dtype) group. Private in torch (no public equivalent);
# a plain alias, so the step path pays no extra call.
foreach_norm = torch._foreach_norm


def foreach_norms(tensors: list[Tensor], ord: float = 2, *, dtypes: tuple[torch.dtype, ...] = ()) -> list[Tensor]:
    """``foreach_norm`` accumulated in the first of ``dtypes`` the backend accepts for these tensors; without a
    ``dtype`` (each tensor's own) when it accepts none (float64 tensors do not downcast; MPS has no float64)."""
    for dtype in dtypes:
        try:
            return list(foreach_norm(tensors, ord, dtype=dtype))
        except (TypeError, RuntimeError):
            continue
    return list(foreach_norm(tensors, ord))


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own ``self.log`` writes at (``_batches_that_stepped``); fallback ``global_step``."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def train_batch_idx(trainer: pl.Trainer) -> int:
    """The index of the training batch in its epoch (the fit loop's counter); ``-1`` outside training."""
    return int(trainer.fit_loop.epoch_loop.batch_idx) if trainer.training else -1


def batch_counter(trainer: pl.Trainer) -> int:
    """Training batches started so far in this fit (identifies the current batch, micro-batches included)."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    progress = getattr(getattr(loop, "batch_progress", None), "total", None)
    return int(getattr(progress, "ready", -1))


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


def get_scaler(trainer: pl.Trainer) -> Any | None:
    """The GradScaler the precision plugin drives (16-mixed), or ``None`` (32-true, bf16, true half)."""
    return getattr(trainer.precision_plugin, "scaler", None)


def active_scaler(trainer: pl.Trainer) -> Any | None:
    """The precision plugin's GradScaler when it is enabled, else ``None``."""
    scaler = get_scaler(trainer)
    return scaler if scaler is not None and scaler.is_enabled() else None


def current_scale(trainer: pl.Trainer) -> float | None:
    """The enabled GradScaler's scale (one host read), or ``None`` without one."""
    scaler = active_scaler(trainer)
    return None if scaler is None else float(scaler.get_scale())


def optimizer_handles_unscaling(optimizer: Optimizer) -> bool:
    """Fused optimizers unscale inside their kernel: with a GradScaler their grads are still scaled in the hook."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def scale_tensor(scaler: Any) -> Tensor | None:
    """The scaler's current scale as a device tensor, without the host read ``get_scale()`` does."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale
    if scaler is not None and scaler.is_enabled():
        return torch.tensor(float(scaler.get_scale()))
    return None


def scaler_state(scaler: Any) -> tuple[float, int]:
    """The scaler's current scale and growth tracker in one host read; the initial values before its lazy init."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor):
        both = torch.stack([scale.detach().reshape(()).double(), tracker.detach().reshape(()).double()])
        value, count = both.tolist()
        return float(value), int(count)
    # Public fallback: get_scale() returns the initial scale while ``_scale`` is still None (first step not taken).
    get_tracker = getattr(scaler, "_get_growth_tracker", None)
    return float(scaler.get_scale()), int(get_tracker()) if callable(get_tracker) else 0


def clamp_scale(scaler: Any, low: float, high: float | None) -> None:
    """Keep the scaler's scale in ``[low, high]``: in place on the device, no host read.

    Before the scaler's lazy init (``_scale is None``) the initial scale it will start from is clamped instead.
    """
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        scale.clamp_(min=low, max=high)
        return
    init = getattr(scaler, "_init_scale", None)
    if isinstance(init, (int, float)):
        scaler._init_scale = min(max(float(init), low), high if high is not None else float("inf"))
        return
    current = float(scaler.get_scale())  # public fallback: one host read, then update(new_scale)
    clamped = min(max(current, low), high if high is not None else float("inf"))
    if clamped != current:
        scaler.update(clamped)


def strategy_class_names(trainer: pl.Trainer) -> set[str]:
    """Names of the strategy's classes (its MRO), to recognize strategies whose packages may not be installed."""
    return {cls.__name__ for cls in type(trainer.strategy).__mro__}


def accepts_found_inf(optimizer: Optimizer) -> bool:
    """A fused optimizer whose kernel skips the update when its ``found_inf`` attribute is set (torch Adam, AdamW,
    SGD, Adagrad with ``fused=True``): the verdict can stay on the device."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return all(bool(group.get("fused")) for group in optimizer.param_groups)


def set_found_inf(optimizer: Optimizer, flag: Tensor) -> None:
    """Hand a 0-d bool verdict to a fused optimizer: its kernel skips params, moments and step counts on 1.0."""
    optimizer.found_inf = flag.to(torch.float32)  # type: ignore[attr-defined]


def _found_inf_per_device(scaler: Any, optimizer: Optimizer) -> dict[torch.device, Tensor] | None:
    """The GradScaler's ``found_inf`` tensors for ``optimizer`` (filled by ``unscale_``), or ``None`` before it ran
    (a fused optimizer unscales inside its step)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    return state.get("found_inf_per_device") if isinstance(state, dict) else None


_ONES: dict[torch.device, Tensor] = {}


def flag_nonfinite(found: Tensor, values: Tensor) -> None:
    """Set ``found`` (a float32 one-element tensor) to 1.0 where ``values`` holds a NaN or an inf; leave it as it is
    otherwise (an OR). One device op, the GradScaler's own check (``values`` is multiplied in place by exactly 1.0),
    where ``~isfinite(values).all()`` and an OR are four."""
    one = _ONES.get(values.device)
    if one is None:
        one = _ONES[values.device] = torch.ones((), dtype=torch.float32, device=values.device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([values], found, one)
    except (NotImplementedError, RuntimeError):  # a backend without the kernel: the same verdict in four ops
        torch.maximum(found, (~torch.isfinite(values).all()).to(found.dtype), out=found)


def set_found_inf_where_nonfinite(optimizer: Optimizer, values: Tensor) -> None:
    """``set_found_inf`` with the verdict "``values`` holds a NaN or an inf", made on the device in two ops."""
    found = torch.zeros((), dtype=torch.float32, device=values.device)
    flag_nonfinite(found, values)
    optimizer.found_inf = found  # type: ignore[attr-defined]


def or_nonfinite_into_found_inf(scaler: Any, optimizer: Optimizer, values: Tensor) -> None:
    """``or_into_found_inf`` with the verdict "``values`` holds a NaN or an inf": straight into the scaler's
    ``found_inf`` (one op) where it lives on the device of ``values``."""
    found = _found_inf_per_device(scaler, optimizer)
    if found and all(t.device == values.device and t.dtype == torch.float32 for t in found.values()):
        for t in found.values():
            flag_nonfinite(t, values)
        return
    or_into_found_inf(scaler, optimizer, ~torch.isfinite(values).all())


def clear_found_inf(optimizer: Optimizer) -> None:
    """Remove what ``set_found_inf`` left (a later step outside nanguard must not read a stale verdict)."""
    if "found_inf" in vars(optimizer):
        del optimizer.found_inf  # type: ignore[attr-defined]


def or_into_found_inf(scaler: Any, optimizer: Optimizer, flag: Tensor) -> None:
    """Make the GradScaler drop this optimizer's update (and back off its scale) when ``flag`` is true, on the device.

    Non-fused optimizers: ``unscale_`` has filled ``found_inf_per_device`` before ``on_before_optimizer_step``; the
    flag is OR-ed into it, so the scaler's own read in ``step`` decides (no extra host read), and every rank's scaler
    backs off together when the verdict was reduced across ranks. Fused optimizers (not unscaled yet): the first
    gradient element becomes inf where ``flag`` is true, so the scaler's own check finds it.
    """
    found = _found_inf_per_device(scaler, optimizer)
    if found:
        for t in found.values():
            torch.maximum(t, flag.to(device=t.device, dtype=t.dtype), out=t)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                head = p.grad.view(-1)[:1]
                head.copy_(torch.where(flag.to(head.device), torch.full_like(head, torch.inf), head))
                return


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``: whether it saves a directory of shards (Lightning
    keeps the argument in a private attribute; its default is ``True``)."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", True))


def fsdp1_state_dict_type(strategy: Any) -> str:
    """``FSDPStrategy(state_dict_type=...)``: ``"full"`` (its default: one file) or ``"sharded"`` (a directory)."""
    return str(getattr(strategy, "_state_dict_type", "full"))


_ShardedTensor: Any = None
try:  # FSDP1's SHARDED_STATE_DICT holds ShardedTensors (without a device mesh); absent from some torch builds
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor as _ShardedTensor
except ImportError:  # pragma: no cover - depends on the torch build
    pass


def local_shards(obj: Any) -> list[Tensor] | None:
    """This rank's local shards of a ``ShardedTensor`` (FSDP1's sharded state dict), or ``None`` for anything else."""
    if _ShardedTensor is not None and isinstance(obj, _ShardedTensor):
        return [shard.tensor for shard in obj.local_shards()]
    return None


def instance_attribute(obj: object, name: str) -> Any:
    """``obj``'s own instance attribute ``name`` (one that overrides the class's method), or ``None``."""
    return vars(obj).get(name)


def checkpoint_scaler_scale(checkpoint: Mapping[str, Any], trainer: pl.Trainer) -> float | None:
    """The GradScaler scale a Lightning checkpoint saved (under the precision plugin's class name), or ``None``."""
    state = checkpoint.get(type(trainer.precision_plugin).__qualname__) or {}
    scale = state.get("scale") if isinstance(state, dict) else None
    return None if scale is None else float(scale)


def checkpoint_log_step(checkpoint: Mapping[str, Any], default: int) -> int:
    """The logging step (the fit loop's ``_batches_that_stepped``) a Lightning checkpoint saved, else ``default``."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    return int(loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", default))


def host_buffer_marked(tensor: Tensor) -> bool:
    """``tensor`` (or the tensor it is a view of) is marked ``_nanguard_host``: pinned host memory a device vector
    was copied into, whose reads are host reads, not device synchronizations."""
    base = tensor._base if tensor._base is not None else tensor
    return bool(getattr(base, "_nanguard_host", False))


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

    def set(self, obj: object, name: str, value: Any) -> None:
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


def tensorboard_one_event(logger: Any, metrics: Mapping[str, float], step: int) -> bool:
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


def agree_scaler_skip(trainer: pl.Trainer, optimizer: Optimizer) -> None:
    """Under DDP with a GradScaler: make every rank's scaler skip (and back off) when any rank's found an inf.

    DDP's gradients are identical on every rank after the all-reduce, but a fault after it (or a rank-local
    overflow in ``unscale_``) makes one scaler skip and halve its scale while the others step: the ranks' weights and
    scales split for good. One SUM all-reduce of the local verdict, on the device (no host read); used when no
    nanguard member senses the steps (the sensor's reduced verdict does the same otherwise).
    """
    from lightning_nanguard import _distributed
    from lightning_nanguard.signals.tensors import all_finite

    scaler = get_scaler(trainer)
    found = _found_inf_per_device(scaler, optimizer)
    if found:
        local = torch.stack([t.reshape(()).float() for t in found.values()]).amax()
    else:  # a fused optimizer unscales inside its step: read its (still scaled) gradients
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        local = (~all_finite(grads)).float()
    reduced = _distributed.sum_across_ranks(trainer, local.reshape(1))[0] > 0
    or_into_found_inf(scaler, optimizer, reduced)


def clear_found_inf_of(trainer: pl.Trainer, opt_idx: int) -> None:
    if opt_idx < len(trainer.optimizers):
        clear_found_inf(trainer.optimizers[opt_idx])


def true_flag(optimizer: Optimizer) -> Tensor:
    """A 0-d ``True`` on the optimizer's device."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return torch.ones((), dtype=torch.bool, device=p.device)
    return torch.ones((), dtype=torch.bool)


def clipping_possible(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether Lightning can clip gradients in this fit: a ``gradient_clip_val`` is set, or the module overrides
    ``configure_gradient_clipping`` (which may clip with values of its own). Otherwise the precision plugin's
    ``clip_gradients`` is only ever called with ``clip_val=0`` and returns at once, dropped update or not."""
    if trainer.gradient_clip_val:
        return True
    return type(pl_module).configure_gradient_clipping is not pl.LightningModule.configure_gradient_clipping


def guard_clipping(trainer: pl.Trainer, allowed: Any) -> None:
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


def train_batch_samplers(trainer: pl.Trainer) -> list[Any]:
    """The batch samplers of the training DataLoaders of the running fit (empty before they exist)."""
    from torch.utils.data import DataLoader

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = getattr(combined, "flattened", None) or []
    return [dl.batch_sampler for dl in loaders if isinstance(dl, DataLoader) and dl.batch_sampler is not None]
