"""torch internals: the fused foreach norms, pytree's ``tree_map``, a tensor's base, FSDP1's ``ShardedTensor``,
FSDP2's module class (``reshard_fsdp2``); and ``first_element``, the one in-place view of a tensor's first element
that every layout has."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = [
    "aten_op",
    "ddp_ignored_names",
    "first_element",
    "foreach_copy_",
    "foreach_norm",
    "foreach_norms",
    "host_buffer_marked",
    "inner_schedulers",
    "is_compiled",
    "local_shards",
    "reshard_fsdp2",
    "scaler_factors",
    "sparse_values",
    "stored_values",
    "tree_map",
]


# torch's fused per-tensor norms: one kernel per (device, dtype) group. Private in torch (no public equivalent);
# a plain alias, so the step path pays no extra call.
foreach_norm = torch._foreach_norm


# torch's fused copy of tensor lists (the snapshot's copies): private in torch, a plain alias like ``foreach_norm``.
foreach_copy_ = torch._foreach_copy_


def aten_op(name: str) -> Any | None:
    """The aten operator overload ``name`` spells (``"aten.div.Tensor"``: ``torch.ops.aten.div.Tensor``), or ``None``
    where it spells none: only aten's operator table is looked up, never a namespace, module or method a name could
    reach otherwise (a bundle's op name is data)."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten" or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return None
    try:
        packet = getattr(torch.ops.aten, parts[1])
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or parts[2] not in packet.overloads():  # type: ignore[no-untyped-call]
        return None
    op = getattr(packet, parts[2])
    return op if isinstance(op, torch._ops.OpOverload) else None


def ddp_ignored_names(module: torch.nn.Module) -> set[str]:
    """The parameter and buffer names DDP was told to ignore (they may differ by rank)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())


_WIDE = (torch.float32, torch.float64)


def foreach_norms(
    tensors: list[Tensor], ord: float = 2, *, dtypes: tuple[torch.dtype, ...] = (), cast: torch.dtype | None = None
) -> list[Tensor] | tuple[Tensor, ...]:
    """Per-tensor ``ord``-norms of one group (one device, one dtype) in one ``foreach_norm``, accumulated in the first
    of ``dtypes`` the backend accepts. Float32/float64 tensors at least as wide as the first of ``dtypes`` take their
    own dtype (no conversion: the healthy step's gradients); where the backend accepts none of ``dtypes`` (an older
    torch, no float64 on MPS), their own, cast to ``cast`` where given. The one wrapper of ``foreach_norm``."""
    own = tensors[0].dtype
    if dtypes and own in _WIDE and own.itemsize >= dtypes[0].itemsize:
        return foreach_norm(tensors, ord)
    for dtype in dtypes:
        try:
            return list(foreach_norm(tensors, ord, dtype=dtype))
        except (TypeError, RuntimeError):
            continue
    norms = list(foreach_norm(tensors, ord))
    return norms if cast is None else [n.to(cast) for n in norms]


def host_buffer_marked(tensor: Tensor) -> bool:
    """``tensor`` (or the tensor it is a view of) is marked ``_nanguard_host``: pinned host memory a device vector
    was copied into, whose reads are host reads, not device synchronizations."""
    base = tensor._base if tensor._base is not None else tensor
    return bool(getattr(base, "_nanguard_host", False))


def _imported_class(module: str, name: str) -> Any:
    """The class ``module.name`` if something imported ``module``, else ``None``: an object of a class exists only once
    its module was imported, and importing torch.distributed's FSDP and sharded-tensor modules up front takes ~0.5 s
    (``nanguard verify`` would pay it for every plain checkpoint)."""
    return getattr(sys.modules.get(module), name, None)


def local_shards(obj: object) -> list[Tensor] | None:
    """This rank's local shards of a ``ShardedTensor`` (FSDP1's sharded state dict), or ``None`` for anything else."""
    # FSDP1's SHARDED_STATE_DICT holds ShardedTensors (without a device mesh); absent from some torch builds
    sharded_tensor = _imported_class("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")
    if sharded_tensor is not None and isinstance(obj, sharded_tensor):
        return [shard.tensor for shard in obj.local_shards()]
    return None


def reshard_fsdp2(module: torch.nn.Module, *, failed: bool = False) -> None:
    """Every FSDP2 (``fully_shard``) module in ``module`` holds its sharded parameters again.

    FSDP2 keeps the root module's parameters all-gathered after a forward, for the backward it expects next (its
    ``reshard_after_forward`` is off for the root), and only that backward reshards them. A forward with no backward
    (a scoring under ``no_grad``) leaves them so: plain full tensors registered on the modules in place of the
    ``DTensor`` shards the optimizer holds, stale as soon as the shards are written (an optimizer step, a restore).
    ``reshard()`` frees them and registers the shards again: local, no communication. ``failed``: the forward raised
    midway; FSDP2's per-iteration state is reset first (``reset_iter_state`` on the root, where torch has it).
    Nothing for a module without FSDP2."""
    # FSDP2's module class: public from torch 2.6, under ``_composable`` before; absent from some torch builds
    fsdp_module = _imported_class("torch.distributed.fsdp", "FSDPModule") or _imported_class(
        "torch.distributed._composable.fsdp", "FSDPModule"
    )
    if fsdp_module is None:
        return
    units = [m for m in module.modules() if isinstance(m, fsdp_module)]
    if failed and units:
        reset = getattr(units[0], "reset_iter_state", None)
        if reset is not None:
            try:
                reset()
            except RuntimeError:  # the outermost unit is not FSDP2's root (only submodules are sharded)
                pass
    for unit in units:
        unit.reshard()


def sparse_values(g: Tensor) -> Tensor:
    """The stored values of a sparse tensor, each index once (a COO tensor coalesced; the compressed layouts hold each
    index once already): a dense tensor with the sparse one's norm."""
    return g.coalesce()._values() if g.layout is torch.sparse_coo else g.values()


def stored_values(t: Tensor) -> Tensor:
    """The values a sparse tensor stores, as a dense tensor, without coalescing (a finiteness check needs every
    stored value, not each index once): COO's value tensor, or the compressed layouts' (CSR, CSC, BSR, BSC)."""
    return t._values() if t.layout is torch.sparse_coo else t.values()


def inner_schedulers(scheduler: object) -> list[object]:
    """The schedulers inside torch's composite ``SequentialLR`` / ``ChainedScheduler`` (empty for any other)."""
    return list(getattr(scheduler, "_schedulers", []) or [])


def scaler_factors(scaler: object) -> tuple[float | None, float | None]:
    """The GradScaler's ``(growth_factor, backoff_factor)`` (``None`` where it does not keep them as floats)."""
    grow, back = getattr(scaler, "_growth_factor", None), getattr(scaler, "_backoff_factor", None)
    return (grow if isinstance(grow, float) else None, back if isinstance(back, float) else None)


def first_element(t: Tensor) -> Tensor:
    """A view of ``t``'s first element (0-d), to write one value in place whatever its strides: ``t.view(-1)`` fails
    for a non-contiguous tensor (a transposed weight and its gradient), and ``reshape`` may copy. ``t`` has at least
    one element."""
    return t[(0,) * t.dim()] if t.dim() else t


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs under ``torch.compile``: a LightningModule that Lightning unwrapped from
    ``torch.compile(model)`` (its ``_compiler_ctx``), or one holding a compiled submodule (``OptimizedModule``)."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    # torch.compile imports dynamo: where it is not imported, nothing is compiled (and importing it takes ~1 s).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and any(isinstance(m, eval_frame.OptimizedModule) for m in module.modules())
