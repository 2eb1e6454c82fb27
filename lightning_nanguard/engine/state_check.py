"""Is the training state finite? Parameters and buffers (and optimizer state on the incident path), rank-reduced.

One fused pass per (device, dtype) group and one host read; the verdict is reduced across ranks so every rank acts
on it together. The names of the non-finite tensors are found only when the verdict is bad.

Sharded tensors (``DTensor``: FSDP2, tensor parallelism) are checked through their local shards: each rank checks
its own pieces and the reduction makes the verdict global, with no ``DTensor`` op (which could start a collective on
one rank only). Sparse tensors are checked through the values they store and a lazy module's parameters from the
forward that materializes them on (``signals/stored.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.signals.model_tensors import intended_infinities, model_tensors, nonfinite_names
from lightning_nanguard.signals.sharded import is_sharded
from lightning_nanguard.signals.stored import stored_values
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["StateVerdict", "model_finite", "state_before_update", "state_verdict"]


def _intended_have_nan(module: nn.Module) -> Tensor | None:
    skip = intended_infinities(module)
    if not skip:
        return None
    values = [stored_values(b) for n, b in module.named_buffers() if n in skip]
    flags = [torch.isnan(v).any() for v in values if v is not None]
    return torch.stack(flags).any() if flags else None


@dataclass(frozen=True)
class StateVerdict:
    """The state check's result, identical on every rank.

    Attributes:
        finite: every rank's parameters and buffers (and the optimizers' state, where asked) are finite.
        diverged: under DDP, the replicated parameters whose copies differ across ranks (compared by their 2-norms);
            empty when they agree, on a single process and for sharded (``DTensor``) parameters.
    """

    finite: bool
    diverged: tuple[str, ...] = ()

    @property
    def sound(self) -> bool:
        return self.finite and not self.diverged


def state_verdict(trainer: pl.Trainer, module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> StateVerdict:
    """Check the state: one fused finiteness pass, and under DDP a fused 2-norm per replicated parameter, in one MAX
    all-reduce of ``[bad, norms, -norms]`` and one host read. A collective: every rank calls it.

    DDP keeps the ranks' parameters identical only by starting them equal and applying identical updates; it never
    re-broadcasts them, so a finite change on one rank (a rank-local write, a fault after the gradient all-reduce)
    splits the ranks for the rest of the run. Each replicated parameter is summarised by its 2-norm and 1-norm in
    float64; their maximum and minimum over ranks differ exactly where some rank's copy differs in those (a change
    that keeps both norms, a permutation of elements or a sign flip, is not seen).
    """
    tensors = [t for _, t in model_tensors(module)]
    for opt in optimizers:
        for state in opt.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, Tensor))  # read by all_finite's stored_values
    local_bad = ~all_finite(tensors, wide=True)
    nan_in_intended = _intended_have_nan(module)
    if nan_in_intended is not None:
        local_bad = local_bad | nan_in_intended.to(local_bad.device)
    replicas = _replicated_parameters(module) if trainer.world_size > 1 else []
    if not replicas:
        return StateVerdict(finite=not _distributed.any_rank(trainer, local_bad))
    params = [p for _, p in replicas]
    norms = torch.stack([n.to(local_bad.device, torch.float64) for n in (*_norms(params, 2), *_norms(params, 1))])
    vec = torch.cat([local_bad.to(torch.float64).reshape(1), norms, -norms])
    vec = _distributed.max_across_ranks(trainer, vec)
    k = norms.numel()
    differ = vec[1 : k + 1] != -vec[k + 1 :]
    bad, split = torch.stack([vec[0] > 0, differ.any()]).tolist()
    if bad or not split:
        return StateVerdict(finite=not bad)
    where = torch.nonzero(differ).reshape(-1).tolist()  # incident path only
    names = dict.fromkeys(replicas[i % len(replicas)][0] for i in where)
    return StateVerdict(finite=True, diverged=tuple(names))


def model_finite(trainer: pl.Trainer, module: nn.Module, optimizers: Sequence[Optimizer] = ()) -> bool:
    """True on every rank iff the state is sound: every rank's parameters and buffers (and ``optimizers``' state)
    are finite (the buffers whose infinities are intended: free of NaN), and under DDP the ranks' parameters agree
    (``state_verdict``)."""
    return state_verdict(trainer, module, optimizers).sound


_F64 = (torch.float64,)  # a difference of one ulp in one element still shows


def _replicated_parameters(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters every rank holds a full, identical copy of (plain DDP): none when any is sharded (a
    ``DTensor``: each rank holds other pieces), without those DDP was told to ignore; each as the tensor a check reads
    (``stored_values``: a sparse parameter's stored values)."""
    named = list(module.named_parameters())
    if any(is_sharded(p) for _, p in named):
        return []
    ignored = _lightning_compat.ddp_ignored_names(module)
    out = []
    for n, p in named:
        values = None if n in ignored else stored_values(p)
        if values is not None and values.numel() and values.is_floating_point():
            out.append((n, values.detach()))
    return out


def _norms(tensors: list[Tensor], ord: int) -> list[Tensor]:
    """Per-tensor ``ord``-norms in order, accumulated in float64 where the device has it (a difference of one ulp
    in one element still shows), one ``_foreach_norm`` per (device, dtype) run."""
    out: list[Tensor] = []
    start = 0
    while start < len(tensors):
        end = start + 1
        key = (tensors[start].device, tensors[start].dtype)
        while end < len(tensors) and (tensors[end].device, tensors[end].dtype) == key:
            end += 1
        out.extend(_lightning_compat.foreach_norms(tensors[start:end], ord, dtypes=_F64, cast=torch.float64))
        start = end
    return out


def state_before_update(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[bool, list[str]]:
    """The state check of a bad step, taken before its update (collective: every rank calls it, rank-reduced)."""
    optimizers = list(trainer.optimizers)
    if state_verdict(trainer, pl_module, optimizers).finite:
        return True, []
    gathered = _distributed.all_gather_objects(trainer, nonfinite_names(pl_module, optimizers))
    return False, sorted({n for part in gathered for n in part})
