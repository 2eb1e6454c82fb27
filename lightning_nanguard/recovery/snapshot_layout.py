"""The byte layout of a snapshot: the training state as a stream of bytes, and which of them each rank keeps.

Every tensor of the state (parameters, buffers, optimizer state) is seen as its bytes in memory order (``byte_view``:
a ``uint8`` view, no copy) at an offset aligned to 16 bytes. Under DDP every rank holds the same parameters and
optimizer state, so those tensors form one *shared stream* of ``N`` bytes of which rank ``r`` keeps the chunk
``[r * chunk, (r + 1) * chunk)`` (``chunk``: ``N / world`` rounded up to 16 bytes), the flat partition of DeepSpeed
ZeRO; a restore gathers the other ranks' chunks. What a rank must keep whole forms its *local region*, after its
chunk: buffers (DDP lets them differ between its broadcasts: BatchNorm statistics of each rank's own batch),
parameters DDP was told to ignore and their optimizer state, and every tensor of a sharded model (FSDP, DTensor:
already this rank's own piece). A tensor that is not dense in memory (overlapping or with gaps) has no byte view and
is kept as a typed copy; one whose elements share memory (an expanded buffer) cannot be written in place, so a restore
puts the copy in its place where its values changed (only a new tensor under its name can have changed them). A sparse tensor (a graph's adjacency buffer, SGD's momentum for a sparse gradient) has no
fixed size (how many values it stores changes): it is *kept*, a host copy made at each snapshot, outside the slot's
preallocated bytes and the ``max_bytes`` budget.

The 16-byte alignment makes every piece of a tensor inside a chunk start at a multiple of its element size, so a
piece can be viewed in its own dtype (the finiteness check of a snapshot's optimizer state reads the chunk so).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ALIGN",
    "KEPT",
    "LOCAL",
    "SHARED",
    "TYPED",
    "Entry",
    "Layout",
    "TensorSpec",
    "byte_view",
    "overlapping",
    "plan_layout",
    "spec_of",
]

ALIGN = 16
SHARED, LOCAL, TYPED, KEPT = "shared", "local", "typed", "kept"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dense(t: Tensor) -> bool:
    """``t`` covers one gap-free block of memory exactly once (contiguous in some order of its dimensions)."""
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1), key=lambda x: x[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def overlapping(t: Tensor) -> bool:
    """Some of ``t``'s elements share memory (an expanded tensor: stride 0 on a dimension of size > 1; an
    ``unfold``-ed one): nothing can be written into it in place, a restore included."""
    extent = 0  # the furthest element reachable through the dimensions of smaller stride
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1), key=lambda x: x[1]
    ):
        if stride <= extent:
            return True
        extent += (size - 1) * stride
    return False


def byte_view(t: Tensor) -> Tensor | None:
    """The bytes of ``t`` in memory order, as a 1-d ``uint8`` view sharing its storage; ``None`` if ``t`` is not
    dense (the caller then copies it as a typed tensor).

    Always through ``as_strided`` to one flat run of its elements, never ``reshape``: a dimension of size 1 may have
    any stride, 0 included (an expanded one-element tensor: Pyro's guides make such parameters, and Adam's state
    inherits the stride), and torch calls such a tensor contiguous while ``reshape(-1)`` keeps the stride 0, which
    has no byte view."""
    t = t.detach()
    if not (t.is_contiguous() or _dense(t)):
        return None
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)


class TensorSpec(NamedTuple):
    """What a layout needs to know of one tensor of the state (a tuple: made and compared once per tensor and
    snapshot, so it is kept cheap)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    kind: str  # "param" | "buffer" | "opt"
    shareable: bool  # identical on every rank (a plain DDP parameter or its optimizer state)
    dense: bool = True
    sparse: bool = False  # a sparse layout (COO, CSR, ...): kept as a host copy, not in the slot's bytes

    @property
    def nbytes(self) -> int:
        if self.sparse:
            return 0
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


def spec_of(t: Tensor, kind: str, shareable: bool) -> TensorSpec:
    if t.layout is not torch.strided:
        return TensorSpec(tuple(t.shape), (), t.dtype, t.device, kind, False, False, True)
    dense = t.is_contiguous() or _dense(t)
    return TensorSpec(tuple(t.shape), t.stride(), t.dtype, t.device, kind, shareable, dense)


@dataclass(frozen=True)
class Entry:
    """One tensor's place in a snapshot: its ``region`` (shared stream, local region or typed copy) and byte offset
    there (its index among the typed copies for ``TYPED``)."""

    spec: TensorSpec
    region: str
    offset: int


@dataclass(frozen=True)
class Piece:
    """The bytes ``[start, end)`` of entry ``index``'s tensor, found at ``pos`` in the range asked for."""

    index: int
    start: int
    end: int
    pos: int


@dataclass(frozen=True)
class Layout:
    """Where every tensor of the state goes in a slot, for ``world`` ranks (``world == 1``: nothing is shared). The
    offset of a ``TYPED`` or ``KEPT`` entry is its index among the slot's typed or kept copies."""

    entries: tuple[Entry, ...]
    shared_bytes: int  # N: the shared stream
    local_bytes: int
    world: int
    rank: int
    chunk: int  # bytes of the shared stream each rank keeps (0 when nothing is shared)

    @property
    def slot_bytes(self) -> int:
        """Host bytes one slot needs on this rank (its chunk, then its local region; typed copies not included)."""
        return self.chunk + self.local_bytes

    @property
    def typed_bytes(self) -> int:
        return sum(e.spec.nbytes for e in self.entries if e.region == TYPED)

    @property
    def sharded(self) -> bool:
        return self.chunk > 0

    def own_range(self, rank: int | None = None) -> tuple[int, int]:
        """The bytes of the shared stream that ``rank`` (this rank by default) keeps."""
        r = self.rank if rank is None else rank
        return min(r * self.chunk, self.shared_bytes), min((r + 1) * self.chunk, self.shared_bytes)

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """The pieces of shared tensors inside the stream's bytes ``[lo, hi)``, in order."""
        shared = self._shared
        k = max(0, bisect.bisect_right(self._starts, lo) - 1)
        out = []
        for i in shared[k:]:
            e = self.entries[i]
            if e.offset >= hi:
                break
            a, b = max(lo, e.offset), min(hi, e.offset + e.spec.nbytes)
            if a < b:
                out.append(Piece(i, a - e.offset, b - e.offset, a - lo))
        return out

    @cached_property
    def _shared(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if e.region == SHARED and e.spec.nbytes]

    @cached_property
    def _starts(self) -> list[int]:
        return [self.entries[i].offset for i in self._shared]


def plan_layout(specs: Sequence[TensorSpec], world: int, rank: int, shard: bool) -> Layout:
    """Place ``specs`` in order: shareable dense tensors in the shared stream when ``shard`` and ``world > 1``,
    other dense tensors in the local region, sparse ones as kept copies, the rest as typed copies."""
    shared = local = typed = kept = 0
    entries = []
    for spec in specs:
        if spec.sparse:
            entries.append(Entry(spec, KEPT, kept))
            kept += 1
        elif not spec.dense:
            entries.append(Entry(spec, TYPED, typed))
            typed += 1
        elif shard and world > 1 and spec.shareable:
            entries.append(Entry(spec, SHARED, shared))
            shared = _aligned(shared + spec.nbytes)
        else:
            entries.append(Entry(spec, LOCAL, local))
            local = _aligned(local + spec.nbytes)
    chunk = _aligned(-(-shared // world)) if shared else 0
    return Layout(tuple(entries), shared, local, world, rank, chunk)
