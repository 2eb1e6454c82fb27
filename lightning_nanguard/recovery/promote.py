"""Run one training module in float32 from now on: autocast off for its forward, its inputs cast to float32.

The remedy for a half-precision overflow that keeps recurring in the same module under ``*-mixed`` (what the VMamba
authors did by hand for their selective scan). The module's parameters are float32 already under autocast, so nothing
is cast but its floating-point inputs; its outputs are float32 and the surrounding autocast region takes them as
they are. Under ``*-true`` the parameters themselves are half precision: there is nothing to switch off, and the
remedy policy never plans a promotion there.

A promotion is an ordinary module: the instance's class is swapped for a subclass of its own class,
``Float32Forward`` first in its bases, created once per class and kept in a module-level registry. The subclass's
``forward`` runs the class's own ``forward`` (the one the instance is) under autocast off, so a ``copy.deepcopy``
(``AveragedModel``, EMA helpers) is an independent promoted module running its own weights; pickling
(``torch.save(model)``) rebuilds the subclass from the original class by ``__reduce_ex__``, so loading needs only the
user's class importable; the state dict is the original's (no key added: it loads into a fresh, unpromoted model and
back); ``print(model)`` shows the module as ``Linear[float32](...)``; ``demote`` swaps the original class back.
"""

from __future__ import annotations

from typing import Any, SupportsIndex, cast

import torch
from torch import Tensor, nn

from lightning_nanguard._lightning_compat import tree_map

__all__ = ["Float32Forward", "demote", "is_promoted", "original_class", "promote", "promote_submodule"]

_DEVICE = "_nanguard_autocast_device"  # the instance's autocast device type ("cpu", "cuda"): what it switches off
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}  # original class -> its promoted subclass


class Float32Forward:
    """The first base of a promoted module's class: its forward runs with autocast off, on float32 inputs."""

    def forward(self, *args: object, **kwargs: object) -> Any:
        device = vars(self).get(_DEVICE, "cpu")
        with torch.autocast(device_type=device, enabled=False):
            args, kwargs = tree_map(_to_float32, (args, kwargs))
            return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _get_name(self) -> str:
        return f"{original_class(cast(nn.Module, self)).__name__}[float32]"  # a mixin of Module subclasses only

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # Pickled as the original class plus a marker: loading needs only the user's class, not this subclass.
        module = cast(nn.Module, self)  # a mixin of Module subclasses only
        return _rebuild, (original_class(module),), module.__getstate__()  # type: ignore[no-untyped-call]


def _rebuild(base: type[nn.Module]) -> nn.Module:
    cls = _promoted_class(base)
    return cls.__new__(cls)


def _promoted_class(base: type[nn.Module]) -> type[nn.Module]:
    cls = _CLASSES.get(base)
    if cls is None:
        name = f"Float32{base.__name__}"
        cls = type(name, (Float32Forward, base), {"__module__": __name__, "__qualname__": name})
        _CLASSES[base] = cls
    return cls


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before its promotion (its own class when it is not promoted)."""
    cls = type(module)
    return next((base for base, sub in _CLASSES.items() if sub is cls), cls)


def is_promoted(module: nn.Module) -> bool:
    return isinstance(module, Float32Forward)


def promote(module: nn.Module, device_type: str) -> bool:
    """Swap ``module``'s class for its float32 subclass (the instance, nothing else). False if it already was
    promoted, or if the instance has a ``forward`` of its own (a wrapper another library set: it would shadow the
    class's)."""
    if is_promoted(module) or "forward" in vars(module):
        return False
    vars(module)[_DEVICE] = device_type
    module.__class__ = _promoted_class(type(module))
    return True


def demote(module: nn.Module) -> bool:
    """Undo ``promote``: the module's forward runs under the surrounding autocast again. False if it was not
    promoted."""
    if not is_promoted(module):
        return False
    module.__class__ = original_class(module)
    vars(module).pop(_DEVICE, None)
    return True


def _to_float32(value: object) -> Any:
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
    if "forward" in vars(target) and not is_promoted(target):
        return False, f"{path} was not moved to float32: its instance has a forward of its own (a wrapper's)"
    return promote(target, device_type), f"moved {path} to float32 from now on (autocast off for its forward)"
