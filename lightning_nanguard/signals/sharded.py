"""Sharded tensors (``DTensor``: FSDP2's ``fully_shard``, tensor parallelism) seen as this rank's local pieces.

Every nanguard pass over parameters, gradients and optimizer state reads the *local* tensor of a ``DTensor``
(``to_local()``: a view of the same storage, no communication). A ``DTensor`` op would start a collective (a
redistribution, or the all-reduce that ``bool()`` of a sharded reduction hides) on whichever rank calls it, and a
collective started on one rank only hangs the run; local reads never do.

A global quantity is then one SUM all-reduce of local contributions. For a squared 2-norm each rank contributes its
local squared norm times ``share``: the fraction of the world that holds *distinct* pieces of the tensor
(``shards / world``). Shards are disjoint, so their squared norms add up; a piece held by ``world / shards`` ranks
(replicated: HSDP's replicate dimension, a tensor-parallel group outside the tensor's mesh, or a plain tensor under
data parallelism) is counted once in total. Under plain DDP every tensor is plain and every share is ``1 / world``.

FSDP1 (``FSDPStrategy(use_orig_params=True)``): the original parameters are plain tensors, flat views of the rank's
piece of a flat shard; ``signals/fsdp1.py`` writes each one's share on it once at setup, and ``is_sharded`` and
``share_of`` read it. Their local piece is the tensor itself.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import Tensor

from lightning_nanguard.signals.fsdp1 import SHARE_ATTR as _SHARE_ATTR  # an FSDP1 parameter's share, set at setup

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "dtensor_spec",
    "from_local_like",
    "is_sharded",
    "local_grads",
    "local_tensor",
    "original_name",
    "share_of",
]

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _is_dtensor(t: object) -> TypeGuard[DTensor]:
    """``t`` is a ``DTensor``. A DTensor exists only once ``torch.distributed.tensor`` is imported (absent from some
    torch builds): looked up there, not imported, since importing it takes ~0.5 s that ``nanguard verify`` would pay
    for every plain checkpoint."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def is_sharded(t: object) -> bool:
    """``t`` is a ``DTensor`` (a parameter, gradient or optimizer state tensor of a sharded model), or an FSDP1
    original parameter (a view of this rank's piece of a flat shard, marked at setup)."""
    return _is_dtensor(t) or getattr(t, _SHARE_ATTR, None) is not None


def local_tensor(t: Tensor) -> Tensor:
    """This rank's piece of ``t``: the local shard of a ``DTensor`` (same storage, no communication), else ``t``."""
    if _is_dtensor(t):
        with torch.no_grad():  # no autograd node: the plain local tensor, a view of the DTensor's own storage
            return t.to_local()
    return t


def local_grads(params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Each gradient's local piece (``local_tensor``); for an FSDP1 parameter whose piece on this rank is empty
    (``numel() == 0``: FSDP1 sets its gradient to ``None`` there), the empty parameter itself stands for a present
    gradient of norm 0, so that every rank counts the same gradients as present (its global norm comes from the
    ranks that hold pieces of it). Only while some gradient is present here: with none at all (a dropped step), none
    is made up."""
    out: list[Tensor | None] = []
    some = any(g is not None for g in grads)
    for p, g in zip(params, grads, strict=True):
        if g is None:
            if some and p.requires_grad and p.numel() == 0 and getattr(p, _SHARE_ATTR, None) is not None:
                out.append(p.detach())
            else:
                out.append(None)
        else:
            out.append(local_tensor(g))
    return out


def original_name(name: str) -> str:
    """A parameter name without the wrapper modules FSDP1 (and activation checkpointing) insert
    (``body.0._fsdp_wrapped_module.weight`` -> ``body.0.weight``); other names unchanged."""
    if "_wrapped_module." not in name:
        return name
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def share_of(t: Tensor, world_size: int) -> float:
    """The weight of this rank's local squared norm of ``t`` in a SUM over ``world_size`` ranks (module docstring).

    ``shards / world_size``, where ``shards`` is the number of distinct pieces of the tensor: the product of the
    mesh sizes along its ``Shard`` placements (1 for a plain or replicated tensor).
    """
    if world_size <= 1:
        return 1.0
    marked = getattr(t, _SHARE_ATTR, None)  # FSDP1: shard group size / world, written at setup
    if marked is not None:
        return float(marked)
    shards = 1
    if _is_dtensor(t):
        mesh = t.device_mesh
        for dim, placement in enumerate(t.placements):
            if placement.is_shard():
                shards *= mesh.size(dim)
    return min(1.0, shards / world_size)


def dtensor_spec(t: Tensor) -> tuple[Any, ...] | None:
    """What ``from_local_like`` needs to rebuild ``t`` from a local tensor; ``None`` for a plain tensor."""
    if _is_dtensor(t):
        return (t.device_mesh, tuple(t.placements), t.shape, t.stride())
    return None


def from_local_like(local: Tensor, spec: tuple[Any, ...] | None) -> Tensor:
    """A ``DTensor`` with ``local`` as this rank's piece and the layout ``spec`` recorded (no communication)."""
    if spec is None:
        return local
    from torch.distributed.tensor import DTensor  # imported already: the spec was read from a DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
