"""Every cross-rank call nanguard makes. Each function must be called by all ranks, every time, in the same order."""

from __future__ import annotations

from typing import TypeVar

import lightning.pytorch as pl
import torch
from torch import Tensor

T = TypeVar("T")

__all__ = [
    "all_gather_objects",
    "any_rank",
    "any_rank_each",
    "bad_ranks",
    "barrier",
    "broadcast_object",
    "destroy_process_group",
    "max_across_ranks",
    "sum_across_ranks",
]


def any_rank(trainer: pl.Trainer, flag: Tensor | bool) -> bool:
    """True on every rank if ``flag`` is true on at least one. One host read; one all-reduce under DDP."""
    if trainer.world_size <= 1:
        return bool(flag.item()) if isinstance(flag, Tensor) else bool(flag)
    local = flag.detach().float().reshape(()) if isinstance(flag, Tensor) else torch.tensor(float(flag))
    total = trainer.strategy.reduce(local.to(trainer.strategy.root_device), reduce_op="sum")
    return bool(total.item() > 0)


def any_rank_each(trainer: pl.Trainer, flags: list[Tensor | bool]) -> list[bool]:
    """``any_rank`` for several flags at once: one all-reduce of a small vector and one host read for all of them."""
    if not flags:
        return []
    device = next((f.device for f in flags if isinstance(f, Tensor)), torch.device("cpu"))
    local = torch.stack(
        [
            f.detach().float().reshape(()).to(device)
            if isinstance(f, Tensor)
            else torch.tensor(float(f), device=device)
            for f in flags
        ]
    )
    if trainer.world_size > 1:
        local = trainer.strategy.reduce(local.to(trainer.strategy.root_device), reduce_op="sum")
    # Packed into one integer so that the single host read is one plain ``.item()``.
    bits = (local > 0).to(torch.int64) * (2 ** torch.arange(len(flags), device=local.device))
    packed = int(bits.sum().item())
    return [bool(packed >> i & 1) for i in range(len(flags))]


def bad_ranks(trainer: pl.Trainer, flag: Tensor | bool) -> list[int]:
    """The ranks whose local ``flag`` is true. An all-gather: call it only on the (rare) incident path."""
    local = flag.detach().float().reshape(1) if isinstance(flag, Tensor) else torch.tensor([float(flag)])
    if trainer.world_size <= 1:
        return [0] if bool(local.item()) else []
    gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device)).reshape(-1)
    return [int(i) for i in torch.nonzero(gathered > 0).reshape(-1).tolist()]


def barrier(trainer: pl.Trainer) -> None:
    """Every rank waits here until every rank has arrived (the strategy's barrier; nothing on one process)."""
    if trainer.world_size > 1:
        trainer.strategy.barrier("nanguard")


def broadcast_object(trainer: pl.Trainer, obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (every rank passes one of the same type)."""
    return trainer.strategy.broadcast(obj, src=src)


def sum_across_ranks(trainer: pl.Trainer, vec: Tensor) -> Tensor:
    """``vec`` summed over ranks (one all-reduce; no host read). A NaN/inf on any rank is non-finite on every rank."""
    return _all_reduce(trainer, vec, "sum")


def max_across_ranks(trainer: pl.Trainer, vec: Tensor) -> Tensor:
    """The element-wise maximum of ``vec`` over ranks (one all-reduce; no host read)."""
    return _all_reduce(trainer, vec, "max")


def _all_reduce(trainer: pl.Trainer, vec: Tensor, op: str) -> Tensor:
    if trainer.world_size <= 1:
        return vec
    # A copy: the all-reduce is in place, and the caller keeps ``vec`` as this rank's own values.
    reduced = trainer.strategy.reduce(vec.to(trainer.strategy.root_device, copy=True), reduce_op=op)
    assert isinstance(reduced, Tensor)
    return reduced


def all_gather_objects(trainer: pl.Trainer, obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable; every rank passes one of the same type), in rank order. A collective:
    incident path only, on every rank."""
    if trainer.world_size <= 1:
        return [obj]
    import torch.distributed as dist

    out: list[T] = [obj] * trainer.world_size  # each entry replaced by that rank's
    dist.all_gather_object(out, obj)
    return out


def destroy_process_group() -> None:
    """Tear down the default process group where one is up (the end of a multi-process run; nothing otherwise)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Sharded snapshots (recovery/snapshot_gather.py): each DDP rank keeps a chunk of the training state's bytes, and a
# restore gathers every rank's chunk on every rank.


def collective_device(trainer: pl.Trainer) -> torch.device:
    """The device this rank's collectives take their tensors on: the strategy's root device (the rank's GPU under
    NCCL, the CPU under gloo)."""
    return trainer.strategy.root_device


def all_gather_equal(trainer: pl.Trainer, out: Tensor, local: Tensor) -> None:
    """Every rank's ``local`` (the same number of elements on every rank), concatenated in rank order into ``out``
    (``world_size * local.numel()`` elements, on ``collective_device``). A collective: every rank calls it, with the
    same sizes, in the same order."""
    if trainer.world_size <= 1:
        out.copy_(local)
        return
    import torch.distributed as dist

    # ``all_gather_single`` where torch has it (it deprecates ``all_gather_into_tensor`` there).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)
