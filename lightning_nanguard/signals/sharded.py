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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["dtensor_spec", "from_local_like", "is_sharded", "local_tensor", "local_tensors", "share_of"]

_DTensor: Any = None
try:  # torch.distributed may be unavailable (some builds): then nothing is a DTensor
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - depends on the torch build
    pass


def is_sharded(t: Any) -> bool:
    """``t`` is a ``DTensor`` (a parameter, gradient or optimizer state tensor of a sharded model)."""
    return _DTensor is not None and isinstance(t, _DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's piece of ``t``: the local shard of a ``DTensor`` (same storage, no communication), else ``t``."""
    if _DTensor is not None and isinstance(t, _DTensor):
        with torch.no_grad():  # no autograd node: the plain local tensor, a view of the DTensor's own storage
            return t.to_local()
    return t


def local_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``local_tensor`` of each."""
    return [local_tensor(t) for t in tensors]


def share_of(t: Tensor, world_size: int) -> float:
    """The weight of this rank's local squared norm of ``t`` in a SUM over ``world_size`` ranks (module docstring).

    ``shards / world_size``, where ``shards`` is the number of distinct pieces of the tensor: the product of the
    mesh sizes along its ``Shard`` placements (1 for a plain or replicated tensor).
    """
    if world_size <= 1:
        return 1.0
    shards = 1
    if _DTensor is not None and isinstance(t, _DTensor):
        mesh = t.device_mesh
        for dim, placement in enumerate(t.placements):
            if placement.is_shard():
                shards *= mesh.size(dim)
    return min(1.0, shards / world_size)


def dtensor_spec(t: Tensor) -> tuple[Any, ...] | None:
    """What ``from_local_like`` needs to rebuild ``t`` from a local tensor; ``None`` for a plain tensor."""
    if _DTensor is not None and isinstance(t, _DTensor):
        return (t.device_mesh, tuple(t.placements), t.shape, t.stride())
    return None


def from_local_like(local: Tensor, spec: tuple[Any, ...] | None) -> Tensor:
    """A ``DTensor`` with ``local`` as this rank's piece and the layout ``spec`` recorded (no communication)."""
    if spec is None or _DTensor is None:
        return local
    mesh, placements, shape, stride = spec
    return _DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
