"""The tensors of the training state by name: which are checked for finiteness, and which are non-finite.

Buffers that hold infinities (and no NaN) when training starts, such as an attention mask of -inf registered as a
buffer, are constants, not damage: they are checked for NaN only (a NaN is never intended), every other tensor for
NaN and inf. Every tensor is read through ``signals/stored.py``: a sharded tensor (``DTensor``) through this rank's
local shard, a sparse one through the values it stores; a lazy module's parameters and buffers are left out until a
forward has materialized them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard.signals.sharded import original_name
from lightning_nanguard.signals.stored import stored_values

__all__ = [
    "intended_infinities",
    "model_tensors",
    "nonfinite_names",
    "record_intended_infinities",
    "watched_buffers",
]

# The buffers of each module whose infinities are intended, recorded at the start of training.
_INTENDED: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def record_intended_infinities(module: nn.Module) -> list[str]:
    """At the start of training: remember the buffers that hold +-inf but no NaN (a host read per such buffer's
    check, once per fit). Returns their names."""
    names = []
    for name, buf in module.named_buffers():
        t = stored_values(buf)
        if t is None or not t.is_floating_point() or not t.numel():
            continue
        if bool(torch.isinf(t).any()) and not bool(torch.isnan(t).any()):
            names.append(name)
    _INTENDED[module] = frozenset(names)
    return names


def intended_infinities(module: nn.Module) -> frozenset[str]:
    return _INTENDED.get(module, frozenset())


def watched_buffers(module: nn.Module) -> list[Tensor]:
    """The floating-point buffers checked for NaN and inf at every step (the tensors ``stored_values`` reads; not the
    intended ones, nor the uninitialized ones of a lazy module)."""
    skip = intended_infinities(module)
    out = []
    for name, buf in module.named_buffers():
        t = None if name in skip else stored_values(buf)
        if t is not None and t.is_floating_point() and t.numel():
            out.append(t)
    return out


def model_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters then buffers by name, as the tensors a check reads (``stored_values``: the local shard of a
    ``DTensor``, the stored values of a sparse tensor), without the buffers whose infinities are intended
    (``record_intended_infinities``) and the uninitialized tensors of a lazy module."""
    skip = intended_infinities(module)
    named = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n not in skip)]
    out = []
    for n, t in named:
        values = stored_values(t)
        if values is not None:
            out.append((n, values))
    return out


def _bad(t: Tensor | None) -> bool:
    if t is None or not t.is_floating_point() or t.numel() == 0:
        return False
    return not bool(torch.isfinite(t).all())


def nonfinite_names(module: nn.Module, optimizers: Sequence[Optimizer] = (), limit: int = 20) -> list[str]:
    """This rank's non-finite parameters, buffers and optimizer-state tensors, by name (incident path only)."""
    out: list[str] = []
    for name, t in model_tensors(module):
        if _bad(t):
            out.append(original_name(name))  # FSDP1: without its `_fsdp_wrapped_module.`
    skip = intended_infinities(module)
    for n, b in module.named_buffers():
        values = stored_values(b) if n in skip else None
        if values is not None and bool(torch.isnan(values).any()):
            out.append(n)
    names = {id(p): original_name(n) for n, p in module.named_parameters()}
    for i, opt in enumerate(optimizers):
        for p, state in opt.state.items():
            for k, v in state.items():
                if isinstance(v, Tensor) and _bad(stored_values(v)):
                    out.append(f"optimizer{i}.{names.get(id(p), '?')}.{k}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])
