"""Lightning's strategies and checkpoint layout: strategy classes, their private settings, instance attributes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Lightning is imported by whoever passes a Trainer; verifying a file needs torch alone
    import lightning.pytorch as pl

__all__ = [
    "checkpoint_log_step",
    "checkpoint_scaler_scale",
    "fsdp1_handle",
    "fsdp1_original_params",
    "fsdp1_state_dict_type",
    "fsdp1_uses_orig_params",
    "has_instance_attribute",
    "instance_attribute",
    "pop_instance_attribute",
    "saves_distributed_checkpoint",
    "set_instance_attribute",
    "strategy_class_names",
]


def strategy_class_names(trainer: pl.Trainer) -> set[str]:
    """Names of the strategy's classes (its MRO), to recognize strategies whose packages may not be installed."""
    return {cls.__name__ for cls in type(trainer.strategy).__mro__}


def saves_distributed_checkpoint(strategy: object) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``: whether it saves a directory of shards (Lightning
    keeps the argument in a private attribute; its default is ``True``)."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", True))


def fsdp1_state_dict_type(strategy: object) -> str:
    """``FSDPStrategy(state_dict_type=...)``: ``"full"`` (its default: one file) or ``"sharded"`` (a directory)."""
    return str(getattr(strategy, "_state_dict_type", "full"))


def instance_attribute(obj: object, name: str) -> Any:
    """``obj``'s own instance attribute ``name`` (one that overrides the class's method), or ``None``."""
    return vars(obj).get(name)


def set_instance_attribute(obj: object, name: str, value: object) -> None:
    """Keep ``value`` as ``obj``'s own instance attribute ``name`` (a mark or hook nanguard attaches to an object it
    does not own, such as a DataLoader's batch sampler)."""
    vars(obj)[name] = value


def has_instance_attribute(obj: object, name: str) -> bool:
    """``obj`` has its own instance attribute ``name`` (``None`` included)."""
    return name in vars(obj)


def pop_instance_attribute(obj: object, name: str) -> Any:
    """Remove and return ``obj``'s own instance attribute ``name`` (``None`` when it has none)."""
    return vars(obj).pop(name, None)


def checkpoint_scaler_scale(checkpoint: Mapping[str, Any], trainer: pl.Trainer) -> float | None:
    """The GradScaler scale a Lightning checkpoint saved (under the precision plugin's class name), or ``None``."""
    state = checkpoint.get(type(trainer.precision_plugin).__qualname__) or {}
    scale = state.get("scale") if isinstance(state, dict) else None
    return None if scale is None else float(scale)


def checkpoint_log_step(checkpoint: Mapping[str, Any], default: int) -> int:
    """The logging step (the fit loop's ``_batches_that_stepped``) a Lightning checkpoint saved, else ``default``."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    return int(loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", default))


def fsdp1_handle(unit: object) -> Any:
    """The flat-parameter handle of an FSDP1 unit (``None`` for a unit that manages no parameter of its own)."""
    return getattr(unit, "_handle", None)


def fsdp1_uses_orig_params(handle: object) -> bool:
    """FSDP1 kept the original parameters for this handle (``use_orig_params=True``)."""
    return bool(getattr(handle, "_use_orig_params", True))


def fsdp1_original_params(flat: object) -> list[Any]:
    """The original parameters behind an FSDP1 flat parameter, shared ones included."""
    return [*(getattr(flat, "_params", None) or ()), *(getattr(flat, "_shared_params", None) or ())]
