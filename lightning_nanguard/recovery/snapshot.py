"""A ring of in-memory snapshots of the training state, in preallocated CPU buffers, copied with foreach ops.

What a snapshot holds: every parameter and buffer of the module, and every optimizer's per-parameter state (Adam's
moments and step counts, SGD's momentum buffers, ...). Not the optimizer's param-group hyperparameters (lr, eps),
the schedulers, the GradScaler or the RNG: ``AutoRollback`` keeps those as they are (see its docstring).

Copies go both ways with ``torch._foreach_copy_`` into buffers allocated once per slot (PERFORMANCE.md: 1.15-1.4x
cheaper and far steadier than ``clone``/``deepcopy``, which page-fault fresh memory). A restore copies *into* the
live tensors, so nothing ever aliases a snapshot (``Optimizer.load_state_dict`` would). Lazily created optimizer
state (before the first step) is handled: a restore removes state the snapshot did not have and recreates state it
had.

Sharded state (``DTensor`` parameters and optimizer state: FSDP2, tensor parallelism) is snapshotted as each rank's
local shards, into buffers of the local shapes: each rank keeps its own pieces, nothing is gathered, and a restore
copies them back into the same local storage (``to_local()`` is a view of it). Optimizer state that has to be
recreated on restore is rebuilt as a ``DTensor`` of the recorded layout around the restored local tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard.signals.sharded import dtensor_spec, from_local_like, local_tensor
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["Snapshot", "SnapshotRing", "model_tensors"]

EntryKey = tuple[int, int, str]  # (optimizer index, parameter index within that optimizer, state key)


def model_tensors(module: nn.Module) -> list[Tensor]:
    """The module's parameters then buffers, deduplicated (tied weights once), in a stable order; this rank's local
    tensors (the local shard of a ``DTensor``, sharing its storage)."""
    return [local_tensor(t) for t in (*module.parameters(), *module.buffers())]


def _optimizer_entries(
    optimizers: Sequence[Optimizer],
) -> tuple[list[EntryKey], list[Tensor], dict[EntryKey, Any], dict[int, Any]]:
    """The optimizers' tensor state (local tensors), the non-tensor state, and the layout of each DTensor entry."""
    keys: list[EntryKey] = []
    tensors: list[Tensor] = []
    extras: dict[EntryKey, Any] = {}
    specs: dict[int, Any] = {}  # entry position -> DTensor layout (absent for plain tensors)
    for i, opt in enumerate(optimizers):
        for j, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            state = opt.state.get(p)
            if not state:
                continue
            for k, v in state.items():
                if isinstance(v, Tensor):
                    spec = dtensor_spec(v)
                    if spec is not None:
                        specs[len(tensors)] = spec
                    keys.append((i, j, k))
                    tensors.append(local_tensor(v))
                else:
                    extras[(i, j, k)] = copy.deepcopy(v)
    return keys, tensors, extras, specs


def _signature(tensors: Sequence[Tensor]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


@dataclass
class Snapshot:
    """One slot of the ring. ``step``/``log_step``: ``global_step`` and Lightning's logging step at capture."""

    step: int = -1
    log_step: int = -1
    valid: bool = False
    model: list[Tensor] = field(default_factory=list)
    opt_keys: list[EntryKey] = field(default_factory=list)
    opt: list[Tensor] = field(default_factory=list)
    opt_devices: list[torch.device] = field(default_factory=list)
    opt_extras: dict[EntryKey, Any] = field(default_factory=dict)
    opt_specs: dict[int, Any] = field(default_factory=dict)  # DTensor layout of sharded optimizer entries
    scale: float | None = None  # the GradScaler's scale at capture (restored only downward)
    _signature: tuple[Any, ...] = ()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.model, *self.opt))


class SnapshotRing:
    """``capacity`` snapshots; ``take`` overwrites the oldest. Buffers are reused while the state's layout holds.

    Args:
        capacity: number of snapshots kept.
        pin_memory: allocate page-locked buffers (faster device-to-host copies on CUDA).
    """

    def __init__(self, capacity: int, pin_memory: bool = False) -> None:
        self.capacity = capacity
        self.pin_memory = pin_memory
        self.slots = [Snapshot() for _ in range(capacity)]

    # ------------------------------------------------------------------ queries
    def steps(self) -> list[int]:
        """Steps of the valid snapshots, oldest first."""
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

    def clear(self) -> None:
        """Drop all snapshots and their buffers."""
        self.slots = [Snapshot() for _ in range(self.capacity)]

    @staticmethod
    def state_finite(snapshot: Snapshot) -> Tensor:
        """0-d bool: the snapshot's optimizer state is finite (its parameters were checked when it was taken)."""
        return all_finite(snapshot.opt)

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
        candidates = [s for s in self.slots if not (s.valid and s.step == keep)] or self.slots
        slot = min(candidates, key=lambda s: (s.valid, s.step))
        model = model_tensors(module)
        keys, opt, extras, specs = _optimizer_entries(optimizers)
        signature = (_signature(model), tuple(keys), _signature(opt))
        if signature != slot._signature:
            slot.valid = False
            slot.model = [self._empty_like(t) for t in model]
            slot.opt = [self._empty_like(t) for t in opt]
            slot._signature = signature
        slot.valid = False  # until the copy is complete
        _copy(slot.model, model)
        _copy(slot.opt, opt)
        slot.opt_keys = keys
        slot.opt_devices = [t.device for t in opt]
        slot.opt_extras = extras
        slot.opt_specs = specs
        slot.step, slot.log_step, slot.scale = step, log_step, scale
        slot.valid = True
        return slot

    @torch.no_grad()
    def restore(self, snapshot: Snapshot, module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
        """Copy ``snapshot`` into the live module and optimizer state, in place. Param-group hyperparameters stay."""
        model = model_tensors(module)
        if _signature(model) != snapshot._signature[0]:
            raise RuntimeError(
                "nanguard: the module's parameters changed shape or number since the snapshot was taken; "
                "AutoRollback cannot restore it. Do not add or resize parameters during fit."
            )
        dst, src = list(model), list(snapshot.model)
        wanted: dict[tuple[int, int], list[int]] = {}
        for n, (i, j, _) in enumerate(snapshot.opt_keys):
            wanted.setdefault((i, j), []).append(n)
        extras: dict[tuple[int, int], dict[str, Any]] = {}
        for (i, j, k), v in snapshot.opt_extras.items():
            extras.setdefault((i, j), {})[k] = v
        for i, opt in enumerate(optimizers):
            for j, p in enumerate(p for group in opt.param_groups for p in group["params"]):
                entries, extra = wanted.get((i, j), []), extras.get((i, j), {})
                if not entries and not extra:
                    opt.state.pop(p, None)  # the snapshot predates this parameter's state
                    continue
                state = opt.state[p]
                keep = {snapshot.opt_keys[n][2] for n in entries} | set(extra)
                for k in [k for k in state if k not in keep]:
                    del state[k]
                for n in entries:
                    k, buf = snapshot.opt_keys[n][2], snapshot.opt[n]
                    live = state.get(k)
                    live = local_tensor(live) if isinstance(live, Tensor) else None
                    if live is not None and live.shape == buf.shape and live.dtype == buf.dtype:
                        dst.append(live)
                        src.append(buf)
                    else:
                        restored = buf.to(device=snapshot.opt_devices[n], copy=True)
                        state[k] = from_local_like(restored, snapshot.opt_specs.get(n))
                for k, v in extra.items():
                    state[k] = copy.deepcopy(v)
        _copy(dst, src)

    def _empty_like(self, t: Tensor) -> Tensor:
        pin = self.pin_memory and torch.cuda.is_available()
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


def _copy(dst: list[Tensor], src: list[Tensor]) -> None:
    if dst:
        torch._foreach_copy_(dst, src)
