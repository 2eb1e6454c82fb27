"""What a snapshot copies, seen from the live objects: the module's parameters and buffers and the optimizers'
per-parameter state, as this rank's local tensors in a fixed order, with the ``TensorSpec`` of each; and, before the
first optimizer step has created the optimizer state, what it will be (so the buffers are sized once, at fit start).

Parameters and buffers are named (``named_parameters``, ``named_buffers``: tied tensors once, under their first
name), so that a restore finds each tensor again even when the module has changed since: a buffer re-registered at
another size (a rotary cos/sin cache that grew with a longer sequence), a lazy module's parameter materialized by its
first forward (``recovery/snapshot_match.py``). A lazy module's uninitialized tensors hold no value and are left out.

Not the optimizer's param-group hyperparameters (lr, eps), the schedulers, the GradScaler or the RNG: ``AutoRollback``
keeps those as they are (see its docstring).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _lightning_compat
from lightning_nanguard.recovery.snapshot_layout import TensorSpec, spec_of
from lightning_nanguard.signals.sharded import dtensor_spec, from_local_like, is_sharded, local_tensor
from lightning_nanguard.signals.stored import is_uninitialized

__all__ = [
    "EntryKey",
    "LiveState",
    "empty_like_spec",
    "expected_specs",
    "fits",
    "live_state",
    "model_tensors",
    "optimizer_targets",
    "shareable_parameters",
]

EntryKey = tuple[int, int, str]  # (optimizer index, parameter index within that optimizer, state key)

# Per-parameter optimizer state shaped like the parameter, by optimizer class (after its first step), besides the
# scalar step count each keeps. An optimizer not listed is sized like Adam; a bigger state than expected makes the
# first snapshot after the first step reallocate its slot once.
_LIKE_PARAM: dict[str, int] = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Rprop": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "ASGD": 1,
    "SGD": 1,
}


def model_tensors(module: nn.Module) -> list[Tensor]:
    """The module's parameters then buffers, deduplicated (tied weights once), in a stable order; this rank's local
    tensors (the local shard of a ``DTensor``, sharing its storage); a lazy module's uninitialized ones left out."""
    return [local_tensor(t) for t in (*module.parameters(), *module.buffers()) if not is_uninitialized(t)]


def shareable_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters every DDP rank holds an identical full copy of: none when any is sharded (FSDP,
    DTensor: each rank holds its own pieces), without those DDP was told to ignore (they may differ by rank)."""
    named = list(module.named_parameters())
    if any(is_sharded(p) for _, p in named):
        return set()
    ignored = _lightning_compat.ddp_ignored_names(module)
    return {id(p) for n, p in named if n not in ignored}


@dataclass
class LiveState:
    """The live tensors in snapshot order (parameters, buffers, optimizer entries), the names of the module's (the
    first ``n_model``), and what a restore needs to rebuild the optimizer state's structure."""

    tensors: list[Tensor]
    specs: list[TensorSpec]
    n_model: int
    names: tuple[str, ...] = ()
    uninitialized: int = 0  # a lazy module's parameters not yet materialized (left out)
    opt_keys: list[EntryKey] = field(default_factory=list)
    opt_extras: dict[EntryKey, Any] = field(default_factory=dict)  # non-tensor state, deep-copied
    opt_dtensors: dict[int, Any] = field(default_factory=dict)  # optimizer entry position -> DTensor layout


def live_state(module: nn.Module, optimizers: Sequence[Optimizer], shareable: set[int]) -> LiveState:
    """The state as it is now. ``shareable``: ids of the parameters whose tensors (and optimizer state) are identical
    on every rank (``shareable_parameters``; empty where nothing is shared)."""
    every = list(module.named_parameters())
    params = [(n, p) for n, p in every if not is_uninitialized(p)]
    named_buffers = [(n, b) for n, b in module.named_buffers() if not is_uninitialized(b)]
    weights = [local_tensor(p) for _, p in params]
    buffers = [local_tensor(b) for _, b in named_buffers]
    specs = [spec_of(t, "param", id(p) in shareable) for t, (_, p) in zip(weights, params, strict=True)]
    specs += [spec_of(t, "buffer", False) for t in buffers]
    names = tuple(n for n, _ in (*params, *named_buffers))
    state = LiveState(weights + buffers, specs, len(weights) + len(buffers), names, len(every) - len(params))
    for i, opt in enumerate(optimizers):
        for j, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            entries = opt.state.get(p)
            if not entries:
                continue
            for k, v in entries.items():
                if isinstance(v, Tensor):
                    layout = dtensor_spec(v)
                    if layout is not None:
                        state.opt_dtensors[len(state.opt_keys)] = layout
                    t = local_tensor(v)
                    state.opt_keys.append((i, j, k))
                    state.tensors.append(t)
                    state.specs.append(spec_of(t, "opt", id(p) in shareable and layout is None))
                else:
                    state.opt_extras[(i, j, k)] = copy.deepcopy(v)
    return state


def expected_specs(module: nn.Module, optimizers: Sequence[Optimizer], shareable: set[int]) -> list[TensorSpec]:
    """The specs of the state after the first optimizer step (the live ones where the optimizer state exists already,
    as after a resume): for sizing the snapshot buffers before it exists."""
    state = live_state(module, optimizers, shareable)
    specs = state.specs[: state.n_model]
    have = {(i, j) for i, j, _ in state.opt_keys}
    specs += state.specs[state.n_model :]
    for i, opt in enumerate(optimizers):
        like = _like_param(opt)
        for j, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            if (i, j) in have or not p.requires_grad or is_uninitialized(p):
                continue
            t = local_tensor(p.detach())
            ok = id(p) in shareable and dtensor_spec(p) is None
            scalar = torch.empty((), dtype=torch.float32)
            specs.append(spec_of(scalar, "opt", ok))
            specs.extend(spec_of(t, "opt", ok) for _ in range(like))
    return specs


def _like_param(opt: Optimizer) -> int:
    name = type(opt).__name__
    n = _LIKE_PARAM.get(name, 2)
    defaults = getattr(opt, "defaults", {}) or {}
    if name == "SGD" and not defaults.get("momentum"):
        n = 0
    if defaults.get("amsgrad"):
        n += 1
    if name == "RMSprop":
        n += int(bool(defaults.get("momentum"))) + int(bool(defaults.get("centered")))
    return n


def optimizer_targets(
    optimizers: Sequence[Optimizer],
    keys: Sequence[EntryKey],
    specs: Sequence[TensorSpec],
    extras: dict[EntryKey, Any],
    dtensors: dict[int, Any],
    holders: dict[int, tuple[dict[str, Any], str]] | None = None,
) -> list[Tensor]:
    """Give each optimizer the state structure a snapshot had (``keys`` of its tensor entries with their ``specs``,
    ``extras``: its non-tensor values): keys it lacked removed, non-tensor values set, missing or reshaped tensors
    recreated (as ``DTensor``s of the recorded layout where ``dtensors`` has one). The live local tensor of each
    entry, in order, for the restore to copy into; ``holders`` (if given) gets each entry's (state dict, key), where
    a restore that replaces the tensor puts the new one."""
    targets: list[Tensor | None] = [None] * len(keys)
    wanted: dict[tuple[int, int], list[int]] = {}
    for n, (i, j, _) in enumerate(keys):
        wanted.setdefault((i, j), []).append(n)
    by_param: dict[tuple[int, int], dict[str, Any]] = {}
    for (i, j, k), v in extras.items():
        by_param.setdefault((i, j), {})[k] = v
    for i, opt in enumerate(optimizers):
        for j, p in enumerate(p for group in opt.param_groups for p in group["params"]):
            entries, extra = wanted.get((i, j), []), by_param.get((i, j), {})
            if not entries and not extra:
                opt.state.pop(p, None)  # the snapshot predates this parameter's state
                continue
            state = opt.state[p]
            keep = {keys[n][2] for n in entries} | set(extra)
            for k in [k for k in state if k not in keep]:
                del state[k]
            for n in entries:
                k, spec = keys[n][2], specs[n]
                live = state.get(k)
                live = local_tensor(live) if isinstance(live, Tensor) else None
                if live is None or not fits(live, spec):
                    device = spec.device if live is None else live.device  # where the fit's end moved it (CPU)
                    live = empty_like_spec(spec, device)
                    state[k] = from_local_like(live, dtensors.get(n))
                targets[n] = live
                if holders is not None:
                    holders[n] = (state, k)
            for k, v in extra.items():
                state[k] = copy.deepcopy(v)
    found = [t for t in targets if t is not None]
    if len(found) != len(targets):
        raise RuntimeError(
            "nanguard: the optimizers' parameters changed since the snapshot was taken; AutoRollback cannot restore "
            "it. Do not add parameters to an optimizer during fit."
        )
    return found


def fits(t: Tensor, spec: TensorSpec) -> bool:
    """``t`` can take the values of a tensor of ``spec`` as they are: the same shape, memory order and dtype (the
    bytes of a dense tensor; a sparse one takes any sparse tensor of its layout). On any device: copies cross it."""
    if spec.sparse or t.layout is not torch.strided:
        return spec.sparse and t.layout is not torch.strided and t.dtype == spec.dtype
    return (tuple(t.shape), tuple(t.stride()), t.dtype) == (spec.shape, spec.stride, spec.dtype)


def empty_like_spec(spec: TensorSpec, device: torch.device) -> Tensor:
    """An uninitialized tensor of ``spec`` on ``device``, for a restore to copy into (an empty sparse one for a
    sparse spec: the copy brings its indices and values)."""
    if spec.sparse:
        empty = (torch.empty((len(spec.shape), 0), dtype=torch.long), torch.empty(0, dtype=spec.dtype))
        return torch.sparse_coo_tensor(*empty, spec.shape, check_invariants=True).to(device)
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
