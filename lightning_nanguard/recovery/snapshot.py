"""A ring of in-memory snapshots of the training state, in host buffers allocated once, copied with foreach ops.

What a snapshot holds: every parameter and buffer of the module and every optimizer's per-parameter state
(``recovery/snapshot_state.py``). Where: one flat byte buffer per slot, laid out by ``recovery/snapshot_layout.py``;
the bytes of each tensor are copied as they lie in memory (``torch._foreach_copy_``), so a restore is bit-exact and
copies *into* the live tensors: nothing ever aliases a snapshot (``Optimizer.load_state_dict`` would). Lazily created
optimizer state (before the first step) is handled: a restore removes state the snapshot did not have and recreates
state it had (a ``DTensor`` of the recorded layout for a sharded model). A module that changed since the snapshot is
matched by name (``recovery/snapshot_match.py``): a buffer re-registered at another size is reallocated at the
snapshot's; a snapshot that lacks a parameter the module has now (a lazy module's, materialized by the first forward)
cannot restore it, and a rollback passes over it (``mismatch``). Sparse tensors are kept as host copies made at each
snapshot (``recovery/snapshot_slot.py``). The layout follows the state: a snapshot whose tensors differ in shape or
number from the last one's is laid out anew, and its slot reallocated where it no longer fits.

``prepare`` (at fit start, outside the training steps) decides how the snapshots are kept and allocates every slot:

* **Under DDP** (several ranks, nothing sharded) each rank keeps ``1/world`` of the parameters' and optimizer
  state's bytes, plus its own buffers; a restore gathers the other ranks' chunks (``recovery/snapshot_gather.py``,
  collectives in ``_distributed.py``), so every rank ends with the same full state. A sharded model (FSDP, DTensor)
  keeps each rank's own local shards, whole; a single process keeps everything.
* **On CUDA** the slots are page-locked (``recovery/host_memory.py``) and the device-to-host copy runs on a side
  stream while the next forward and backward run (``recovery/side_copy.py``): a snapshot is restorable once its copy
  is complete (``Snapshot.ready``), and only a restore waits for it. On CPU the copy is synchronous.
* **Budget** (``max_bytes``, per rank, every slot together): when the slots do not all fit, fewer slots are kept
  (a warning says how many); when not even one fits, ``NanGuardConfigError`` says what it needs. Checked at fit start
  against the expected state, and again at each snapshot against the real one (the largest need over the ranks, so
  that every rank keeps the same slots).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.recovery.host_memory import host_buffer, release
from lightning_nanguard.recovery.side_copy import SideCopy
from lightning_nanguard.recovery.snapshot_budget import slots_that_fit
from lightning_nanguard.recovery.snapshot_gather import gather_shared
from lightning_nanguard.recovery.snapshot_layout import (
    KEPT,
    LOCAL,
    SHARED,
    TYPED,
    Layout,
    TensorSpec,
    byte_view,
    overlapping,
    plan_layout,
)
from lightning_nanguard.recovery.snapshot_match import mismatch, model_targets, put_kept, replace_tensor
from lightning_nanguard.recovery.snapshot_slot import Snapshot, kept_copy
from lightning_nanguard.recovery.snapshot_state import (
    expected_specs,
    live_state,
    model_tensors,
    optimizer_targets,
    shareable_parameters,
)
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["Snapshot", "SnapshotRing", "model_tensors"]

GATHER_BYTES = 256 * 2**20  # bytes one all-gather round of a sharded restore brings (every rank's slice together)


class SnapshotRing:
    """``capacity`` snapshots; ``take`` overwrites the oldest. Buffers are reused while they are large enough.

    Args:
        capacity: number of snapshots kept.
        pin_memory: page-locked buffers and side-stream copies when the state is on a CUDA device.
        max_bytes: the most host bytes the slots may hold on each rank, together; ``None``: no limit.
        shard: under DDP, keep ``1/world`` of the parameters and optimizer state on each rank.
    """

    def __init__(
        self, capacity: int, pin_memory: bool = False, *, max_bytes: int | None = None, shard: bool = True
    ) -> None:
        self.capacity = capacity
        self.pin_memory = pin_memory
        self.max_bytes = max_bytes
        self.shard = shard
        self.slots = [Snapshot() for _ in range(capacity)]
        self.gather_bytes = GATHER_BYTES
        self.world, self.rank = 1, 0
        self._shareable: set[int] = set()  # parameters whose bytes are spread over the ranks (DDP only)
        self._side: SideCopy | None = None
        self._trainer: weakref.ref[pl.Trainer] | None = None  # weakref to the Trainer (budget agreement across ranks)
        self._layout_of: tuple[tuple[TensorSpec, ...], Layout] | None = None
        # The last snapshot was taken while a lazy module's parameters were uninitialized: it cannot restore the model
        # once they are materialized, so the next batch start takes another (``AutoRollback.before_batch``). Only
        # while they are being materialized: a lazy layer the forward never calls does not make every step a snapshot.
        self.incomplete = False
        self._uninitialized: int | None = None  # at the last take

    # ------------------------------------------------------------------ fit lifecycle
    def prepare(self, trainer: pl.Trainer, module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
        """At fit start: choose sharding and side-stream copies, check the budget, allocate every slot."""
        self.clear()
        self._trainer = weakref.ref(trainer)
        self.world, self.rank = trainer.world_size, trainer.global_rank
        ddp = self.shard and self.world > 1 and isinstance(trainer.strategy, DDPStrategy)
        self._shareable = shareable_parameters(module) if ddp else set()
        layout = self._layout(tuple(expected_specs(module, optimizers, self._shareable)))
        self._fit_budget(layout)
        cuda = [t.device for t in model_tensors(module) if t.is_cuda]
        if self.pin_memory and cuda and all(isinstance(o, Optimizer) for o in optimizers):
            self._side = SideCopy(cuda[0])
            self._side.watch(optimizers)
        for slot in self.slots:
            self._ensure(slot, layout)

    def clear(self) -> None:
        """Drop all snapshots and free their buffers (every copy in flight completes first)."""
        self.sync()
        for slot in self.slots:
            release(slot.flat)
        if self._side is not None:
            self._side.unwatch()
        self._side, self._trainer, self._layout_of = None, None, None
        self.incomplete, self._uninitialized = False, None
        self.slots = [Snapshot() for _ in range(self.capacity)]

    def sync(self) -> None:
        """Block until every copy in flight is complete (before anything writes the live state outside the
        optimizer's update: a restore)."""
        if self._side is not None:
            self._side.wait_all()
        for slot in self.slots:
            slot.wait()

    # ------------------------------------------------------------------ queries
    def steps(self) -> list[int]:
        """Steps of the valid snapshots, oldest first (a snapshot whose copy is in flight included: it completes
        before anything reads it)."""
        return sorted(s.step for s in self.slots if s.valid)

    def get(self, step: int) -> Snapshot | None:
        return next((s for s in self.slots if s.valid and s.step == step), None)

    def discard(self, snapshot: Snapshot) -> None:
        snapshot.valid = False

    def discard_newer(self, step: int) -> None:
        """Forget snapshots taken after ``step`` (they belong to the abandoned trajectory)."""
        for s in self.slots:
            if s.valid and s.step > step:
                s.valid = False

    def nbytes(self) -> int:
        """Host bytes the ring holds on this rank."""
        return sum(s.nbytes() for s in self.slots)

    @staticmethod
    def state_finite(snapshot: Snapshot) -> Tensor:
        """0-d bool: the optimizer state this rank keeps of ``snapshot`` is finite (its parameters were checked when
        it was taken). Waits for its copy. Under DDP each rank checks its own chunk: reduce the verdict."""
        snapshot.wait()
        layout = snapshot.layout
        if layout is None:
            return torch.tensor(True)
        views = [snapshot.view(i) for i, e in enumerate(layout.entries) if i >= snapshot.n_model and e.region != SHARED]
        if layout.sharded and snapshot.flat is not None:
            for p in layout.pieces(*layout.own_range()):
                spec = layout.entries[p.index].spec
                if p.index >= snapshot.n_model:
                    views.append(snapshot.flat[p.pos : p.pos + p.end - p.start].view(spec.dtype))
        return all_finite(views)

    # ------------------------------------------------------------------ copies
    @torch.no_grad()
    def take(
        self,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        *,
        step: int,
        log_step: int,
        scale: float | None = None,
        keep: int | None = None,
    ) -> Snapshot:
        """Copy the live state into the oldest (or an empty) slot. The caller has verified the state is finite.

        ``keep``: the step of a snapshot not to overwrite while another slot can take the copy (the newest sound one,
        so that snapshots taken mid-divergence cannot push the last good state out of the ring).
        """
        state = live_state(module, optimizers, self._shareable)
        layout = self._layout(tuple(state.specs))
        self._fit_budget(layout)
        candidates = [s for s in self.slots if not (s.valid and s.step == keep)] or self.slots
        slot = min(candidates, key=lambda s: (s.valid, s.step))
        slot.valid = False  # until the copy is queued
        slot.wait()
        self._ensure(slot, layout)
        # The copy plan (views of the live tensors' bytes and of the slot) is reused while the layout and every
        # tensor's memory stay the same: most snapshots, at no per-tensor cost beyond reading its address.
        key = (layout, [t.data_ptr() if t.layout is _STRIDED else id(t) for t in state.tensors])
        if slot.plan is None or slot.plan[0] is not layout or slot.plan[1] != key[1]:
            slot.plan = (*key, *self._pairs(slot, layout, state.tensors))
        _, _, dst, src, kinds = slot.plan
        slot.event = self._copy(dst, src, kinds)
        slot.kept = [kept_copy(state.tensors[i]) for i, e in enumerate(layout.entries) if e.region == KEPT]
        slot.layout, slot.n_model, slot.names = layout, state.n_model, state.names
        last, self._uninitialized = self._uninitialized, state.uninitialized
        self.incomplete = state.uninitialized > 0 and (last is None or state.uninitialized < last)
        slot.opt_keys, slot.opt_extras, slot.opt_dtensors = state.opt_keys, state.opt_extras, state.opt_dtensors
        slot.step, slot.log_step, slot.scale = step, log_step, scale
        slot.valid = True
        return slot

    @torch.no_grad()
    def restore(
        self,
        snapshot: Snapshot,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        trainer: pl.Trainer | None = None,
        *,
        model_only: bool = False,
    ) -> None:
        """Copy ``snapshot`` into the live module and optimizer state, in place. Param-group hyperparameters stay.
        ``model_only``: the parameters and buffers only (the optimizer state is not touched). Under DDP a collective
        (``trainer`` needed): every rank restores the same snapshot together."""
        self.sync()
        layout = snapshot.layout
        assert layout is not None
        assert snapshot.flat is not None
        n = snapshot.n_model
        live = live_state(module, optimizers, self._shareable)
        # Matched by name; reshaped tensors reallocated (``snapshot_match``). Raises before anything is written.
        model = model_targets(module, snapshot.names, [e.spec for e in layout.entries[:n]], live)
        holders: dict[int, tuple[dict[str, Any], str]] = {}
        specs = [e.spec for e in layout.entries[n:]]
        dst: list[Tensor | None] = [
            *model,
            *(
                [None] * len(specs)
                if model_only
                else optimizer_targets(
                    optimizers, snapshot.opt_keys, specs, snapshot.opt_extras, snapshot.opt_dtensors, holders
                )
            ),
        ]
        pairs_dst: list[Tensor] = []
        pairs_src: list[Tensor] = []
        for i, e in enumerate(layout.entries):
            target = dst[i]
            if target is None:
                continue
            if e.region == TYPED and overlapping(target):  # no in-place copy into memory its elements share
                kept = snapshot.typed[e.offset]
                if not torch.equal(target, kept.to(target.device)):
                    _put(module, snapshot.names, holders, n, i, e.spec.kind, target, kept.to(target.device, copy=True))
            elif e.region == TYPED:
                pairs_dst.append(target)
                pairs_src.append(snapshot.typed[e.offset])
            elif e.region == LOCAL and e.spec.nbytes:
                start = layout.chunk + e.offset
                pairs_dst.append(_bytes(target))
                pairs_src.append(snapshot.flat[start : start + e.spec.nbytes])
            elif e.region == KEPT:
                new = put_kept(target, snapshot.kept[e.offset])
                if new is not None:
                    _put(module, snapshot.names, holders, n, i, e.spec.kind, target, new)
        if pairs_dst:
            _lightning_compat.foreach_copy_(pairs_dst, pairs_src)
        if layout.sharded:
            if trainer is None:
                raise RuntimeError("nanguard: restoring a snapshot spread over DDP ranks needs the Trainer.")
            shared = [
                _bytes(t) if t is not None and e.region == SHARED else _NO_BYTES
                for t, e in zip(dst, layout.entries, strict=True)
            ]
            gather_shared(trainer, layout, snapshot.flat, shared, self.gather_bytes, n if model_only else None)

    def mismatch(self, snapshot: Snapshot, module: nn.Module, optimizers: Sequence[Optimizer]) -> str | None:
        """Why ``snapshot`` cannot restore ``module`` and ``optimizers`` as they are now (``snapshot_match``), or
        ``None``. Names and shapes only: the same answer on every DDP rank."""
        layout = snapshot.layout
        if layout is None:
            return "it holds nothing"
        live = live_state(module, optimizers, self._shareable)
        n = snapshot.n_model
        reason = mismatch(snapshot.names, [e.spec for e in layout.entries[:n]], live, module)
        if reason is None:
            sizes = [sum(len(g["params"]) for g in opt.param_groups) for opt in optimizers]
            if any(i >= len(sizes) or j >= sizes[i] for i, j, _ in snapshot.opt_keys):
                reason = "the optimizers hold fewer parameters than when it was taken"
        return reason

    # ------------------------------------------------------------------ internals
    def _layout(self, specs: tuple[TensorSpec, ...]) -> Layout:
        cached = self._layout_of
        if cached is not None and cached[0] == specs:
            return cached[1]
        layout = plan_layout(specs, self.world, self.rank, bool(self._shareable))
        self._layout_of = (specs, layout)
        return layout

    def _ensure(self, slot: Snapshot, layout: Layout) -> None:
        """(Re)allocate ``slot``'s buffers where they are too small for ``layout``."""
        if slot.flat is None or slot.flat.numel() < layout.slot_bytes:
            release(slot.flat)
            slot.valid, slot.flat, slot.plan = False, None, None
            slot.flat = host_buffer(layout.slot_bytes, pin=self._pin(layout))
        typed = [e.spec for e in layout.entries if e.region == TYPED]
        if [(tuple(t.shape), t.dtype) for t in slot.typed] != [(s.shape, s.dtype) for s in typed]:
            slot.typed = [torch.empty(s.shape, dtype=s.dtype) for s in typed]  # rare: not worth pinning
            slot.plan = None

    def _pin(self, layout: Layout) -> bool:
        return self.pin_memory and any(e.spec.device.type == "cuda" for e in layout.entries)

    def _fit_budget(self, layout: Layout) -> None:
        """Keep as many slots as ``max_bytes`` holds (``snapshot_budget``), the same number on every rank."""
        if self.max_bytes is None:
            return
        need = layout.slot_bytes + layout.typed_bytes
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None and self.world > 1:
            need = int(_distributed.max_across_ranks(trainer, torch.tensor([float(need)])).item())
        fits = slots_that_fit(self.max_bytes, need, len(self.slots), world=self.world, sharded=layout.sharded)
        if fits < len(self.slots):
            self.sync()
            ordered = sorted(self.slots, key=lambda s: (s.valid, s.step), reverse=True)
            for slot in ordered[fits:]:
                release(slot.flat)
            self.slots = ordered[:fits]

    def _pairs(
        self, slot: Snapshot, layout: Layout, tensors: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor], list[str]]:
        """(destination, source, source kind) of each copy of one take: this rank's pieces of the shared stream, its
        local region, its typed copies."""
        assert slot.flat is not None
        dst: list[Tensor] = []
        src: list[Tensor] = []
        kinds: list[str] = []
        flat = slot.flat
        if layout.sharded:
            for p in layout.pieces(*layout.own_range()):
                dst.append(flat[p.pos : p.pos + p.end - p.start])
                src.append(_bytes(tensors[p.index])[p.start : p.end])
                kinds.append(layout.entries[p.index].spec.kind)
        for i, e in enumerate(layout.entries):
            if e.region == LOCAL and e.spec.nbytes:
                start = layout.chunk + e.offset
                dst.append(flat[start : start + e.spec.nbytes])
                src.append(_bytes(tensors[i]))
            elif e.region == TYPED:
                dst.append(slot.typed[e.offset])
                src.append(tensors[i])
            else:
                continue
            kinds.append(e.spec.kind)
        return dst, src, kinds

    def _copy(self, dst: list[Tensor], src: list[Tensor], kinds: list[str]) -> Any:
        """Copy now (no side stream), or queue the copies on the side stream and return their event."""
        side = self._side
        if side is None:
            if dst:
                _lightning_compat.foreach_copy_(dst, src)
            return None
        host: tuple[list[Tensor], list[Tensor]] = ([], [])
        buffers: tuple[list[Tensor], list[Tensor]] = ([], [])
        state: tuple[list[Tensor], list[Tensor]] = ([], [])
        for d, s, kind in zip(dst, src, kinds, strict=True):
            group = host if not s.is_cuda else buffers if kind == "buffer" else state
            group[0].append(d)
            group[1].append(s)
        return side.start(host, buffers, state)


def _put(
    module: nn.Module,
    names: Sequence[str],
    holders: dict[int, tuple[dict[str, Any], str]],
    n_model: int,
    index: int,
    kind: str,
    old: Tensor,
    new: Tensor,
) -> None:
    """Put ``new`` where entry ``index`` (the live tensor ``old``) is: the module's parameter or buffer of that name,
    or the optimizer state's key."""
    if index < n_model:
        replace_tensor(module, names[index], kind, old, new)
    else:
        state, key = holders[index - n_model]
        state[key] = new


_STRIDED = torch.strided
_NO_BYTES = torch.empty(0, dtype=torch.uint8)  # stands for an entry outside the shared stream (never indexed)


def _bytes(t: Tensor) -> Tensor:
    view = byte_view(t)
    if view is None:  # only dense tensors are placed in byte regions (snapshot_layout)
        raise RuntimeError("nanguard: a snapshot tensor is no longer dense in memory; it cannot be restored.")
    return view
