"""Running an evaluation step in float32 without touching the real parameters (no Trainer needed).

The pieces ``FP32Evaluation`` assembles:

* ``AttributePatches``: set instance attributes and later put back exactly what was there (re-assign the previous
  instance attribute, e.g. a ``torch.compile`` wrapper Lightning installed; delete only what we added);
* ``Fp32Weights``: temporary float32 copies of a half-precision module's floating parameters and buffers, and a call
  of any of its methods on them through the public ``torch.func.functional_call``. The real parameters keep their
  dtype and their autograd nodes, which is what keeps DDP's gradient all-reduce hooks alive (casting them with
  ``module.float()``/``.half()`` silently disconnects them);
* ``DeferredLog``: holds back what a step logged with ``self.log`` until its outputs are known to be finite, so that
  a re-run's values replace, rather than add to, the half-precision ones in Lightning's epoch accumulation;
* ``nonfinite_flag``: one device flag for "anything non-finite in these outputs", read once per batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "AttributePatches",
    "DeferredLog",
    "Fp32Weights",
    "autocast_disabled",
    "default_dtype",
    "floating_tensors",
    "nonfinite_flag",
]


class AttributePatches:
    """Instance-attribute patches that are undone by restoring exactly what was there before.

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


@contextmanager
def autocast_disabled(device_type: str) -> Iterator[None]:
    """Autocast off for ``device_type`` (the step computes in its inputs' and weights' dtype: float32 under AMP)."""
    with torch.autocast(device_type, enabled=False):
        yield


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created without an explicit dtype inside the block get ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _MethodCaller(nn.Module):
    """A module whose forward calls one method of ``owner``, so that ``functional_call`` can reparametrize it."""

    def __init__(self, owner: nn.Module, method: Callable[..., Any]) -> None:
        super().__init__()
        self.owner = owner
        self._method = method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._method(*args, **kwargs)


class Fp32Weights:
    """Float32 copies of ``module``'s floating parameters and buffers, built on first use and then reused.

    Build and use them only while the module's weights do not change (one evaluation epoch); ``release`` frees them.
    Costs one float32 copy of the half-precision weights in memory while held.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._state: dict[str, Tensor] | None = None
        self.builds = 0

    @property
    def built(self) -> bool:
        return self._state is not None

    def state(self) -> dict[str, Tensor]:
        if self._state is None:
            state: dict[str, Tensor] = {}
            with torch.no_grad():
                for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
                    if t.is_floating_point():
                        state["owner." + name] = t.detach().to(torch.float32)
            self._state = state
            self.builds += 1
        return self._state

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` with the module's floating weights swapped for their float32 copies."""
        caller = _MethodCaller(self.module, method)
        return torch.func.functional_call(caller, self.state(), args, kwargs, tie_weights=True, strict=False)

    def release(self) -> None:
        self._state = None


class DeferredLog:
    """Stands in for ``LightningModule.log`` while a step's outcome is undecided.

    ``deferring`` on: calls are recorded, not passed on (``replay`` passes them on in order, ``discard`` drops them).
    ``deferring`` off: calls go straight to ``log_fn``. Lightning's ``log_dict`` calls ``self.log`` and is covered.
    """

    def __init__(self, log_fn: Callable[..., Any]) -> None:
        self.log_fn = log_fn
        self.deferring = False
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.deferring:
            self.calls.append((args, kwargs))
        else:
            self.log_fn(*args, **kwargs)

    def begin(self) -> None:
        self.calls.clear()
        self.deferring = True

    def values(self) -> list[Any]:
        """The logged values (second positional argument or ``value=``) of the recorded calls."""
        out = []
        for args, kwargs in self.calls:
            if len(args) >= 2:
                out.append(args[1])
            elif "value" in kwargs:
                out.append(kwargs["value"])
        return out

    def replay(self) -> None:
        self.deferring = False
        calls, self.calls = self.calls, []
        for args, kwargs in calls:
            self.log_fn(*args, **kwargs)

    def discard(self) -> None:
        self.deferring = False
        self.calls = []


def floating_tensors(obj: Any) -> Iterator[Tensor]:
    """Every floating-point tensor in a step output (a tensor, a mapping, a list/tuple, nested)."""
    if isinstance(obj, Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from floating_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from floating_tensors(v)


def nonfinite_flag(*collections: Any) -> Tensor | bool:
    """True where anything in ``collections`` is NaN/inf: a 0-d device bool tensor (no host read), or a Python bool.

    Python numbers are checked on the host; tensors on the device, reduced to a single flag.
    """
    flags: list[Tensor] = []
    for collection in collections:
        for item in collection if isinstance(collection, list) else [collection]:
            if isinstance(item, (float, int)) and not isinstance(item, bool):
                if not math.isfinite(item):
                    return True
                continue
            flags.extend(torch.isfinite(t).all() for t in floating_tensors(item))
    if not flags:
        return False
    device = flags[0].device
    return ~torch.stack([f.to(device) for f in flags]).all()
