"""Restore the shared stream of a sharded snapshot: every rank's chunk, all-gathered onto every rank, in rounds.

Each round every rank contributes the same slice of its chunk (``bucket / world`` bytes, copied to the collective
device), one all-gather brings every rank's slice, and the pieces are copied into the live tensors' bytes at once.
The memory a restore borrows on the collective device stays bounded (``bucket`` bytes gathered, ``bucket / world``
contributed) however large the model and the world; every rank runs the same rounds, with the same sizes, in the
same order.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.recovery.snapshot_layout import ALIGN, Layout

__all__ = ["gather_shared"]


def gather_shared(
    trainer: pl.Trainer, layout: Layout, flat: Tensor, targets: list[Tensor], bucket: int, entries: int | None = None
) -> None:
    """Write the whole shared stream of ``layout`` into ``targets`` (each live tensor's bytes, in entry order) from
    every rank's ``flat`` (its chunk first), ``bucket`` bytes per all-gather; ``entries``: only the first so many
    entries are written (the model's, for a model-only restore). A collective: every rank calls it together."""
    world, chunk = layout.world, layout.chunk
    size = max(ALIGN, min(chunk, bucket // world // ALIGN * ALIGN))
    device = _distributed.collective_device(trainer)
    on_host = device.type == "cpu"
    send = None if on_host else torch.empty(size, dtype=torch.uint8, device=device)
    out = torch.empty(world * size, dtype=torch.uint8, device=device)
    for start in range(0, chunk, size):
        n = min(size, chunk - start)
        piece = flat[start : start + n]
        if send is not None:
            local = send[:n]
            local.copy_(piece, non_blocking=piece.is_pinned())
        else:
            local = piece
        gathered = out[: world * n]
        _distributed.all_gather_equal(trainer, gathered, local)
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for r in range(world):
            lo = r * chunk + start
            for p in layout.pieces(lo, min(lo + n, layout.shared_bytes)):
                if entries is not None and p.index >= entries:
                    continue
                dst.append(targets[p.index][p.start : p.end])
                at = r * n + p.pos
                src.append(gathered[at : at + p.end - p.start])
        if dst:
            _lightning_compat.foreach_copy_(dst, src)
