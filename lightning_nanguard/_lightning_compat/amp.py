"""The GradScaler's and fused optimizers' internals: the scale, ``found_inf``, and the skip they decide."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_nanguard._lightning_compat.torch_ops import first_element

if TYPE_CHECKING:  # Lightning is imported by whoever passes a Trainer; verifying a file needs torch alone
    import lightning.pytorch as pl

__all__ = [
    "accepts_found_inf",
    "active_scaler",
    "clamp_scale",
    "clear_found_inf",
    "clear_found_inf_of",
    "current_scale",
    "flag_nonfinite",
    "found_inf_per_device",
    "get_scaler",
    "optimizer_handles_unscaling",
    "or_into_found_inf",
    "or_nonfinite_into_found_inf",
    "scale_started",
    "scale_tensor",
    "set_found_inf",
    "set_found_inf_where_nonfinite",
    "true_flag",
]


class _FusedOptimizer(Protocol):
    """A fused optimizer whose kernel skips the update where its ``found_inf`` is set (``accepts_found_inf``)."""

    found_inf: Tensor


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


def scale_tensor(scaler: torch.amp.GradScaler | None) -> Tensor | None:
    """The scaler's current scale as a device tensor, without the host read ``get_scale()`` does."""
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale
    if scaler is not None and scaler.is_enabled():
        return torch.tensor(float(scaler.get_scale()))
    return None


def scale_started(scaler: object) -> bool:
    """The scaler has made its scale tensor (at its first ``scale``); before that it starts from its initial one."""
    return isinstance(getattr(scaler, "_scale", None), torch.Tensor)


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


def accepts_found_inf(optimizer: Optimizer) -> bool:
    """A fused optimizer whose kernel skips the update when its ``found_inf`` attribute is set (torch Adam, AdamW,
    SGD, Adagrad with ``fused=True``): the verdict can stay on the device."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return all(bool(group.get("fused")) for group in optimizer.param_groups)


def set_found_inf(optimizer: Optimizer, flag: Tensor) -> None:
    """Hand a 0-d bool verdict to a fused optimizer: its kernel skips params, moments and step counts on 1.0."""
    cast(_FusedOptimizer, optimizer).found_inf = flag.to(torch.float32)  # the fused kernel reads it


def found_inf_per_device(scaler: object, optimizer: Optimizer) -> dict[torch.device, Tensor] | None:
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
    cast(_FusedOptimizer, optimizer).found_inf = found  # the fused kernel reads it


def or_nonfinite_into_found_inf(scaler: object, optimizer: Optimizer, values: Tensor) -> None:
    """``or_into_found_inf`` with the verdict "``values`` holds a NaN or an inf": straight into the scaler's
    ``found_inf`` (one op) where it lives on the device of ``values``."""
    found = found_inf_per_device(scaler, optimizer)
    if found and all(t.device == values.device and t.dtype == torch.float32 for t in found.values()):
        for t in found.values():
            flag_nonfinite(t, values)
        return
    or_into_found_inf(scaler, optimizer, ~torch.isfinite(values).all())


def clear_found_inf(optimizer: Optimizer) -> None:
    """Remove what ``set_found_inf`` left (a later step outside nanguard must not read a stale verdict)."""
    if "found_inf" in vars(optimizer):
        delattr(optimizer, "found_inf")


def or_into_found_inf(scaler: object, optimizer: Optimizer, flag: Tensor) -> None:
    """Make the GradScaler drop this optimizer's update (and back off its scale) when ``flag`` is true, on the device.

    Non-fused optimizers: ``unscale_`` has filled ``found_inf_per_device`` before ``on_before_optimizer_step``; the
    flag is OR-ed into it, so the scaler's own read in ``step`` decides (no extra host read), and every rank's scaler
    backs off together when the verdict was reduced across ranks. Fused optimizers (not unscaled yet): the first
    gradient element becomes inf where ``flag`` is true, so the scaler's own check finds it.
    """
    found = found_inf_per_device(scaler, optimizer)
    if found:
        for t in found.values():
            torch.maximum(t, flag.to(device=t.device, dtype=t.dtype), out=t)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                head = first_element(p.grad)
                head.copy_(torch.where(flag.to(head.device), torch.full_like(head, torch.inf), head))
                return


def clear_found_inf_of(trainer: pl.Trainer, opt_idx: int) -> None:
    if opt_idx < len(trainer.optimizers):
        clear_found_inf(trainer.optimizers[opt_idx])


def true_flag(optimizer: Optimizer) -> Tensor:
    """A 0-d ``True`` on the optimizer's device."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return torch.ones((), dtype=torch.bool, device=p.device)
    return torch.ones((), dtype=torch.bool)
