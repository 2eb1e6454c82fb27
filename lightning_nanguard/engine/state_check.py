"""Is the training state finite? Parameters and buffers (and optimizer state on the incident path), rank-reduced.

One fused pass per (device, dtype) group and one host read; the verdict is reduced across ranks so every rank acts
on it together. The names of the non-finite tensors are found only when the verdict is bad.

Sharded tensors (``DTensor``: FSDP2, tensor parallelism) are checked through their local shards: each rank checks
its own pieces and the reduction makes the verdict global, with no ``DTensor`` op (which could start a collective on
one rank only).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _distributed
from lightning_nanguard.signals.sharded import local_tensor
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["model_finite", "nonfinite_names", "state_before_update"]


def _model_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters then buffers by name, as this rank's local tensors (the local shard of a ``DTensor``)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(n, local_tensor(t)) for n, t in named]


def model_finite(trainer: pl.Trainer, module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> bool:
    """True on every rank iff every rank's parameters and buffers (and ``optimizers``' state) are finite."""
    tensors = [t for _, t in _model_tensors(module)]
    for opt in optimizers:
        for state in opt.state.values():
            tensors.extend(local_tensor(v) for v in state.values() if isinstance(v, Tensor))
    local_bad = ~all_finite(tensors, wide=True)
    return not _distributed.any_rank(trainer, local_bad)


def nonfinite_names(module: nn.Module, optimizers: Sequence[Optimizer] = (), limit: int = 20) -> list[str]:
    """This rank's non-finite parameters, buffers and optimizer-state tensors, by name (incident path only)."""
    out: list[str] = []
    for name, t in _model_tensors(module):
        if _bad(t):
            out.append(name)
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
