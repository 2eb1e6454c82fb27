"""Every private or version-specific touch of Lightning/torch internals lives here, each with its public fallback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "LoggingSteps",
    "accepts_found_inf",
    "agree_scaler_skip",
    "batch_counter",
    "clamp_scale",
    "clear_found_inf",
    "clear_found_inf_of",
    "clipping_possible",
    "get_scaler",
    "guard_clipping",
    "is_train_logging_step",
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
    "train_batch_samplers",
    "true_flag",
]


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning's own ``self.log`` writes at (``_batches_that_stepped``); fallback ``global_step``."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


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


# ---------------------------------------------------------------------------------------------- training loaders by key
# (recovery/quarantine: the quarantine is kept per training loader, and a batch's rows are mapped per loader)


def train_loaders(trainer: pl.Trainer) -> list[tuple[tuple[Any, ...], Any]]:
    """The running fit's training iterables with the path of each in the batch Lightning builds from them: ``()`` for
    a single DataLoader (the batch is its batch), ``("a",)`` for ``{"a": loader, ...}``, ``(1,)`` for a list's second
    one. Empty before the fit's CombinedLoader exists."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    flattened = getattr(combined, "flattened", None) or []
    paths: dict[int, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
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
