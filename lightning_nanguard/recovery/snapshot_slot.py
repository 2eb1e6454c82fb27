"""One slot of the snapshot ring (``recovery/snapshot.py``): its buffers, what it holds, and views of its entries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.recovery.snapshot_layout import KEPT, SHARED, TYPED, Layout
from lightning_nanguard.recovery.snapshot_state import EntryKey

__all__ = ["Snapshot", "kept_copy"]


@dataclass
class Snapshot:
    """One slot of the ring. ``step``/``log_step``: ``global_step`` and Lightning's logging step at capture."""

    step: int = -1
    log_step: int = -1
    valid: bool = False
    layout: Layout | None = None
    flat: Tensor | None = None  # this rank's bytes: its chunk of the shared stream, then its local region
    typed: list[Tensor] = field(default_factory=list)  # copies of the tensors with no byte view
    kept: list[Tensor] = field(default_factory=list)  # host copies of the sparse tensors, made at each take
    n_model: int = 0  # entries of the module (parameters, buffers); optimizer entries follow
    names: tuple[str, ...] = ()  # the module entries' names
    opt_keys: list[EntryKey] = field(default_factory=list)
    opt_extras: dict[EntryKey, Any] = field(default_factory=dict)
    opt_dtensors: dict[int, Any] = field(default_factory=dict)  # DTensor layout of sharded optimizer entries
    scale: float | None = None  # the GradScaler's scale at capture (restored only downward)
    event: Any = None  # the side-stream copy's completion (CUDA), until it is known complete
    plan: Any = None  # (layout, live tensors' addresses, destinations, sources, kinds) of the last take

    def ready(self) -> bool:
        """The copy is complete (always, for a synchronous copy). Asks without waiting."""
        if self.event is not None and self.event.query():
            self.event = None
        return self.event is None

    def wait(self) -> None:
        """Block until the copy is complete."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def nbytes(self) -> int:
        """Host bytes this slot holds on this rank (its allocated buffers)."""
        flat = 0 if self.flat is None else self.flat.numel()
        kept = sum(_sparse_nbytes(t) for t in self.kept)
        return flat + kept + sum(t.numel() * t.element_size() for t in self.typed)

    def view(self, index: int) -> Tensor:
        """Entry ``index`` as a tensor of its own dtype and shape, viewing this slot's memory (entries this rank
        keeps whole only: a shared entry is spread over the ranks)."""
        assert self.layout is not None
        assert self.flat is not None
        e = self.layout.entries[index]
        if e.region == TYPED:
            return self.typed[e.offset]
        if e.region == KEPT:
            return self.kept[e.offset]
        if e.region == SHARED:
            raise RuntimeError("nanguard: this tensor's snapshot is spread over the DDP ranks; a restore gathers it.")
        start = self.layout.chunk + e.offset
        raw = self.flat[start : start + e.spec.nbytes]
        return raw.view(e.spec.dtype).as_strided(e.spec.shape, e.spec.stride)

    @property
    def model(self) -> list[Tensor]:
        return [self.view(i) for i in range(self.n_model)]

    @property
    def opt(self) -> list[Tensor]:
        return [self.view(self.n_model + n) for n in range(len(self.opt_keys))]


def kept_copy(t: Tensor) -> Tensor:
    """A host copy of a sparse tensor (a COO one coalesced: its indices readable, the same tensor)."""
    copy = t.detach().to("cpu", copy=True)
    return copy.coalesce() if copy.layout is torch.sparse_coo else copy


def _sparse_nbytes(t: Tensor) -> int:
    parts: tuple[Tensor, ...]
    if t.layout is torch.sparse_coo:
        parts = (t.indices(), t.values())
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    else:
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    return sum(p.numel() * p.element_size() for p in parts)
