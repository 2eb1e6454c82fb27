"""Run one training module in float32 from now on: autocast off for its forward, its inputs cast to float32.

The remedy for a half-precision overflow that keeps recurring in the same module under ``*-mixed`` (what the VMamba
authors did by hand for their selective scan). The module's parameters are float32 already under autocast, so nothing
is cast but its floating-point inputs; its outputs are float32 and the surrounding autocast region takes them as
they are. Under ``*-true`` the parameters themselves are half precision: there is nothing to switch off, and the
remedy policy never plans a promotion there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_nanguard._lightning_compat import tree_map

__all__ = ["demote", "is_promoted", "promote", "promote_submodule"]

_MARK = "_nanguard_fp32_forward"
_SAVED = "_nanguard_fp32_saved_forward"  # the instance ``forward`` the promotion replaced (None: the class's)


def is_promoted(module: nn.Module) -> bool:
    return bool(getattr(module, _MARK, False))


def promote(module: nn.Module, device_type: str) -> bool:
    """Wrap ``module.forward`` (an instance attribute: the class is untouched). False if it already was."""
    if is_promoted(module):
        return False
    original = module.forward
    saved = vars(module).get("forward")  # a forward the instance already had (another wrapper), else None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, enabled=False):
            args, kwargs = tree_map(_to_float32, (args, kwargs))
            return original(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    setattr(module, _MARK, True)
    setattr(module, _SAVED, saved)
    return True


def demote(module: nn.Module) -> bool:
    """Undo ``promote``: the module's forward runs under the surrounding autocast again. False if it was not
    promoted."""
    if not is_promoted(module):
        return False
    saved = vars(module).pop(_SAVED, None)
    if saved is None:
        vars(module).pop("forward", None)  # the class's forward again
    else:
        module.forward = saved  # type: ignore[method-assign]
    setattr(module, _MARK, False)
    return True


def _to_float32(value: Any) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def promote_submodule(root: nn.Module, path: str, device_type: str, *, mixed: bool, precision: str) -> tuple[bool, str]:
    """``promote`` the submodule of ``root`` at ``path`` where autocast runs (``mixed``); returns whether it was
    promoted now, and the sentence that says what happened (``precision``: the Trainer's, for that sentence)."""
    try:
        target = root.get_submodule(path)
    except AttributeError:
        return False, f"could not move {path} to float32: no such module"
    if not mixed:
        return False, f"{path} was not moved to float32: under {precision!r} there is no autocast to switch off"
    return promote(target, device_type), f"moved {path} to float32 from now on (autocast off for its forward)"
