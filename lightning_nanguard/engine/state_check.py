"""Is the training state finite? Parameters and buffers (and optimizer state on the incident path), rank-reduced.

One fused pass per (device, dtype) group and one host read; the verdict is reduced across ranks so every rank acts
on it together. The names of the non-finite tensors are found only when the verdict is bad.

Sharded tensors (``DTensor``: FSDP2, tensor parallelism) are checked through their local shards: each rank checks
its own pieces and the reduction makes the verdict global, with no ``DTensor`` op (which could start a collective on
one rank only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _distributed
from lightning_nanguard.signals.sharded import local_tensor
from lightning_nanguard.signals.tensors import all_finite

__all__ = [
    "intended_infinities",
    "model_finite",
    "nonfinite_names",
    "record_intended_infinities",
    "state_before_update",
    "watched_buffers",
]

# Buffers that hold infinities (and no NaN) when training starts: an attention mask of -inf registered as a buffer is
# a constant, not damage. They are checked for NaN only (a NaN is never intended); every other tensor for NaN and inf.
_INTENDED: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def record_intended_infinities(module: nn.Module) -> list[str]:
    """At the start of training: remember the buffers that hold +-inf but no NaN (a host read per such buffer's
    check, once per fit). Returns their names."""
    names = []
    for name, buf in module.named_buffers():
        t = local_tensor(buf)
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.is_floating_point() and t.numel() and bool(torch.isinf(t).any()) and not bool(torch.isnan(t).any()):
            names.append(name)
    _INTENDED[module] = frozenset(names)
    return names


def intended_infinities(module: nn.Module) -> frozenset[str]:
    return _INTENDED.get(module, frozenset())


def watched_buffers(module: nn.Module) -> list[Tensor]:
    """The floating-point buffers checked for NaN and inf at every step (local tensors; not the intended ones)."""
    skip = intended_infinities(module)
    out = []
    for name, buf in module.named_buffers():
        t = local_tensor(buf)
        if t.is_complex():
            t = torch.view_as_real(t)
        if name not in skip and t.is_floating_point() and t.numel():
            out.append(t)
    return out


def _model_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters then buffers by name, as this rank's local tensors (the local shard of a ``DTensor``), without the
    buffers whose infinities are intended (``record_intended_infinities``)."""
    skip = intended_infinities(module)
    named = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n not in skip)]
    return [(n, local_tensor(t)) for n, t in named]


def _intended_have_nan(module: nn.Module) -> Tensor | None:
    skip = intended_infinities(module)
    if not skip:
        return None
    flags = [torch.isnan(local_tensor(b)).any() for n, b in module.named_buffers() if n in skip]
    return torch.stack(flags).any() if flags else None


def model_finite(trainer: pl.Trainer, module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> bool:
    """True on every rank iff every rank's parameters and buffers (and ``optimizers``' state) are finite (the
    buffers whose infinities are intended: free of NaN)."""
    tensors = [t for _, t in _model_tensors(module)]
    for opt in optimizers:
        for state in opt.state.values():
            tensors.extend(local_tensor(v) for v in state.values() if isinstance(v, Tensor))
    local_bad = ~all_finite(tensors, wide=True)
    nan_in_intended = _intended_have_nan(module)
    if nan_in_intended is not None:
        local_bad = local_bad | nan_in_intended.to(local_bad.device)
    return not _distributed.any_rank(trainer, local_bad)


def nonfinite_names(module: nn.Module, optimizers: Sequence[Optimizer] = (), limit: int = 20) -> list[str]:
    """This rank's non-finite parameters, buffers and optimizer-state tensors, by name (incident path only)."""
    out: list[str] = []
    for name, t in _model_tensors(module):
        if _bad(t):
            out.append(name)
    skip = intended_infinities(module)
    out.extend(n for n, b in module.named_buffers() if n in skip and bool(torch.isnan(local_tensor(b)).any()))
    names = {id(p): n for n, p in module.named_parameters()}
    for i, opt in enumerate(optimizers):
        for p, state in opt.state.items():
            for k, v in state.items():
                if isinstance(v, Tensor) and _bad(local_tensor(v)):
                    out.append(f"optimizer{i}.{names.get(id(p), '?')}.{k}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _bad(t: Tensor) -> bool:
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point() or t.numel() == 0:
        return False
    return not bool(torch.isfinite(t).all())


def state_before_update(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[bool, list[str]]:
    """The state check of a bad step, taken before its update (collective: every rank calls it, rank-reduced)."""
    optimizers = list(trainer.optimizers)
    if model_finite(trainer, pl_module, optimizers):
        return True, []
    gathered = _distributed.all_gather_objects(trainer, nonfinite_names(pl_module, optimizers))
    return False, sorted({n for part in gathered for n in part})  # type: ignore[attr-defined]
