"""One fused pass over the gradients: per-tensor norms and the total norm, on the device. No host read.

The per-tensor 2-norms come from a single ``torch._foreach_norm`` per (device, dtype) group, accumulated in float32
so that a large but finite fp16/bf16 gradient does not overflow to inf and read as non-finite. A 2-norm propagates
NaN and inf, so a tensor holding either has a non-finite norm: finiteness and the total norm fall out of the same
pass (docs/PERFORMANCE.md has what that costs against one plain read of the gradients).

Sharded parameters (``DTensor``: FSDP2, tensor parallelism) are read through their local shards, never as
``DTensor``s (``signals/sharded.py``); ``weighted_squares`` gives each tensor's local squared norm weighted by its
share of the world, so that one SUM all-reduce of them is the global squared norm, per tensor and in total.

``ParamIndex`` is built once per optimizer and reused every step, so the per-step work is one list of ``p.grad``
and the kernels: the grouping by device and dtype, the names and the layer groups are computed once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from lightning_nanguard import _lightning_compat
from lightning_nanguard.signals.sharded import is_sharded, local_grads, original_name, share_of

__all__ = [
    "INLINE_MAX",
    "GradNorms",
    "ParamIndex",
    "grad_norms",
    "inline_applies",
    "layer_norms",
    "layer_of",
    "loss_sum",
    "norms_with",
    "step_vector",
    "weighted_squares",
    "wrapper_prefixes",
]


class GradNorms:
    """The gradient norms of one optimizer step, on the gradients' device.

    Attributes:
        tensor_norms: 1-d float32, one norm per gradient tensor, in ``present`` order; divided by ``scale`` if given.
            On the fast path (``norms_with``) the first ``count`` entries of the step vector, sliced on first use.
        present: indices (into ``ParamIndex.params``) of the parameters that had a gradient; ``None`` means all.
        total: 0-d float32, the 2-norm of all gradients (NaN/inf if any element is), computed on first use.
    """

    __slots__ = ("_count", "_tensor_norms", "_total", "_vec", "present")

    def __init__(
        self,
        tensor_norms: Tensor | None = None,
        present: tuple[int, ...] | None = None,
        _total: Tensor | None = None,
        *,
        vec: Tensor | None = None,
        count: int = 0,
    ) -> None:
        if tensor_norms is None and vec is None:
            raise ValueError("GradNorms needs tensor_norms or vec")
        self._tensor_norms = tensor_norms
        self.present = present
        self._total = _total
        self._vec = vec
        self._count = count

    @property
    def tensor_norms(self) -> Tensor:
        norms = self._tensor_norms
        if norms is None:
            assert self._vec is not None
            norms = self._tensor_norms = self._vec[: self._count]
        return norms

    @property
    def total(self) -> Tensor:
        if self._total is None:
            self._total = torch.linalg.vector_norm(self.tensor_norms)
        return self._total


class ParamIndex:
    """The parameters of one optimizer, their names, layer groups and (device, dtype) groups, built once.

    Args:
        params: the optimizer's parameters, in param-group order.
        names: parameter name for each parameter (``""`` when unknown).
        depth: module depth at which parameters are grouped into layers (``1``: top-level children).
        skip_wrappers: module prefixes that wrap the whole model (``"model"`` for ``self.model = nn.Sequential``):
            layers are grouped below them, so ``layer_grad_norm/model`` never just repeats the total.
        world_size: the number of ranks, for the shares of sharded (``DTensor``) parameters.

    Attributes:
        sharded: some parameter is a ``DTensor``: gradients are read through their local shards and the step's
            norms are global only after a SUM all-reduce of ``weighted_squares``.
        sparse: some gradient is sparse (``nn.Embedding(sparse=True)``): the fused pass cannot read it, so every
            step's norms come from ``_grouped_norms`` (each sparse gradient through its coalesced values). Seen in the
            gradients present when the index is built (the first step), or the first time the fused pass refuses one.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        depth: int,
        skip_wrappers: Sequence[str] = (),
        *,
        world_size: int = 1,
    ) -> None:
        self.params = list(params)
        names = [original_name(n) for n in names]  # FSDP1 inserts `_fsdp_wrapped_module.` into the module paths
        self.names = names
        self.count = len(self.params)
        self.groups = [layer_of(_strip(name, skip_wrappers), depth, _prefix(name, skip_wrappers)) for name in names]
        self.layer_names = sorted(set(self.groups))
        position = {name: i for i, name in enumerate(self.layer_names)}
        self.layer_ids = [position[g] for g in self.groups]
        self._index_cache: dict[tuple[int, ...] | None, Tensor] = {}
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for i, p in enumerate(self.params):
            by_key[(p.device, p.dtype)].append(i)
        # One group (the common case) is read with a single foreach call and no reordering.
        self.uniform = len(by_key) == 1
        self.key_groups = list(by_key.values())
        self.accumulate_fp32 = any(p.dtype not in (torch.float32, torch.float64) for p in self.params)
        self.sharded = any(is_sharded(p) for p in self.params)
        self.sparse = any(p.grad is not None and p.grad.layout is not torch.strided for p in self.params)
        self.world_size = world_size
        self._shares = [share_of(p, world_size) for p in self.params] if self.sharded else []
        self._share_cache: dict[torch.device, Tensor] = {}

    def shares(self, device: torch.device) -> Tensor:
        """1-d float64: each parameter's share (``signals/sharded.share_of``), cached per device."""
        cached = self._share_cache.get(device)
        if cached is None:
            cached = self._share_cache[device] = torch.tensor(self._shares, dtype=torch.float64, device=device)
        return cached

    def layer_index(self, present: tuple[int, ...] | None, device: torch.device) -> Tensor:
        """The layer id of each present gradient, as a tensor cached per set of present parameters."""
        cached = self._index_cache.get(present)
        if cached is None or cached.device != device:
            ids = self.layer_ids if present is None else [self.layer_ids[i] for i in present]
            cached = torch.tensor(ids, dtype=torch.long, device=device)
            if len(self._index_cache) > 8:  # the set of present grads is almost always stable; bound the cache
                self._index_cache.clear()
            self._index_cache[present] = cached
        return cached

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Cheap staleness check: the optimizer still holds the same number of parameters, first one unchanged."""
        n, first = 0, None
        for g in optimizer.param_groups:  # a plain loop: this runs every step (sum() over a generator costs more)
            params = g["params"]
            if params and first is None:
                first = params[0]  # an empty first group (weight-decay splits) must not raise here
            n += len(params)
        return n == self.count and (n == 0 or first is self.params[0])


def wrapper_prefixes(module: nn.Module) -> tuple[str, ...]:
    """The chain of single-child wrappers that hold every parameter (``self.model = nn.Sequential(...)``)."""
    prefix, current = "", module
    out: list[str] = []
    total = sum(1 for _ in module.parameters())
    while True:
        children = [(n, c) for n, c in current.named_children() if any(True for _ in c.parameters())]
        if len(children) != 1 or sum(1 for _ in children[0][1].parameters()) != total:
            return tuple(out)
        name, current = children[0]
        prefix = f"{prefix}{name}"
        out.append(prefix)
        prefix += "."


def loss_sum(losses: list[Tensor]) -> Tensor | None:
    """The step's (micro-batch) losses summed, as ``on_before_backward`` passed them (not detached there: a detach is
    a device op; the reading runs under the optimizer's ``no_grad``, so nothing is recorded; detached here where a
    custom optimizer left grad mode on)."""
    if not losses:
        return None
    if torch.is_grad_enabled():
        losses = [loss.detach() for loss in losses]
    if len(losses) == 1:
        loss = losses[0]
        return loss if loss.dim() == 0 else loss.reshape(())
    return torch.stack([loss.reshape(()).float() for loss in losses]).sum()


def _prefix(name: str, wrappers: Sequence[str]) -> str:
    for w in wrappers:
        if name.startswith(w + "."):
            return w + "."
    return ""


def _strip(name: str, wrappers: Sequence[str]) -> str:
    prefix = _prefix(name, wrappers)
    return name[len(prefix) :] if prefix else name


def layer_of(name: str, depth: int, prefix: str = "") -> str:
    """The module path of parameter ``name`` cut at ``depth`` (``"encoder.layers.0.w"``, 2 -> ``"encoder.layers"``)."""
    if not name:
        return "<unnamed>"
    module_path = name.split(".")[:-1]
    if not module_path:
        return prefix.rstrip(".") or "<root>"
    return prefix + ".".join(module_path[:depth])


def grad_norms(index: ParamIndex, scale: Tensor | None = None) -> GradNorms | None:
    """Read the current gradients of ``index.params`` in one fused pass. ``None`` when no parameter has a gradient.

    Args:
        index: the parameters to read.
        scale: divide the norms by this (0-d tensor), for gradients that are still loss-scaled.
    """
    grads = [p.grad for p in index.params]
    if index.sharded:  # local shards only: a DTensor op could start a collective on this rank alone
        grads = local_grads(index.params, grads)
    # `is not None` per item: `None in grads` would call Tensor.__eq__ on every gradient.
    norms: list[Tensor] | tuple[Tensor, ...] | None = None
    present: tuple[int, ...] | None = None
    if index.uniform and not index.sparse and all(g is not None for g in grads):
        if not grads:
            return None
        try:
            norms = _norms_fp32(cast(list[Tensor], grads))  # every one present (checked above)
        except NotImplementedError:  # a sparse gradient that was not there when the index was built
            index.sparse = True
    if norms is None:
        present_list = [i for i, g in enumerate(grads) if g is not None]
        if not present_list:
            return None
        norms = _grouped_norms(index, grads, present_list)
        present = tuple(present_list)
    stacked = torch.stack(norms)
    if scale is not None:
        stacked = stacked / scale.to(device=stacked.device, dtype=stacked.dtype)
    return GradNorms(tensor_norms=stacked, present=present)


INLINE_MAX = 32  # up to this many gradients, the step vector carries each norm and the host sums their squares


def inline_applies(index: ParamIndex) -> bool:
    """Whether ``norms_with`` can read this index: a few (``INLINE_MAX``) plain gradients of one (device, dtype)."""
    return not index.sharded and not index.sparse and index.uniform and 0 < index.count <= INLINE_MAX


def norms_with(index: ParamIndex, tail: Sequence[Tensor]) -> tuple[GradNorms, Tensor] | None:
    """The healthy step's fast path: ``[norm_0, ..., norm_k-1, *tail]`` in one ``stack`` after one fused norm pass,
    for an index ``inline_applies`` to, every gradient present. The total norm is then summed on the host from the
    per-tensor norms (two fewer device ops than a ``vector_norm`` and a second ``stack``; the per-tensor norms are
    sliced out of the vector only where they are used). ``None`` where a gradient is missing (``grad_norms`` then)."""
    try:
        vec = step_vector(index.params, tail)
    except NotImplementedError:  # a sparse gradient that was not there when the index was built: ``grad_norms``
        index.sparse = True
        return None
    return None if vec is None else (GradNorms(present=None, vec=vec, count=index.count), vec)


def step_vector(params: Sequence[Tensor], tail: Sequence[Tensor]) -> Tensor | None:
    """``[norm_0, ..., norm_k-1, *tail]``: each parameter's gradient 2-norm (one fused pass, accumulated in float32
    or wider) and ``tail``, in one ``stack``: the healthy step's two device ops (``norms_with``, ``Sensor.quick``).
    ``None`` where a gradient is missing; raises as the ops do (a sparse gradient, a tail on another device)."""
    grads: list[Tensor] = []
    for p in params:
        g = p.grad
        if g is None:
            return None
        grads.append(g)
    return torch.stack([*_norms_fp32(grads), *tail])


def _grouped_norms(index: ParamIndex, grads: list[Tensor | None], present: list[int]) -> list[Tensor]:
    """Norms of the present gradients, in ``present`` order, one foreach call per (device, dtype) group."""
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    dense: dict[int, Tensor] = {}
    for i in present:
        g = grads[i]
        assert g is not None
        if g.layout is not torch.strided:
            g = _lightning_compat.sparse_values(g)
        dense[i] = g
        by_key[(g.device, g.dtype)].append(i)
    out: dict[int, Tensor] = {}
    device = dense[present[0]].device
    for positions in by_key.values():
        for i, n in zip(positions, _norms_fp32([dense[i] for i in positions]), strict=True):
            out[i] = n if n.device == device else n.to(device)
    return [out[i] for i in present]


def layer_norms(index: ParamIndex, norms: GradNorms) -> tuple[list[str], Tensor]:
    """Per-layer 2-norms from the per-tensor norms: one ``index_add_`` on the device, no host read.

    Returns the names of the layers that had a gradient and a 1-d tensor of their norms, in the same order, so the
    caller ships all of them to the host with a single ``.tolist()``.
    """
    device = norms.tensor_norms.device
    ids = index.layer_index(norms.present, device)
    squares = torch.zeros(len(index.layer_names), dtype=norms.tensor_norms.dtype, device=device)
    squares.index_add_(0, ids, norms.tensor_norms.square())
    present = range(index.count) if norms.present is None else norms.present
    seen = sorted({index.layer_ids[i] for i in present})
    return [index.layer_names[k] for k in seen], squares[seen].sqrt()


def weighted_squares(index: ParamIndex, norms: GradNorms | None, device: torch.device) -> Tensor:
    """1-d float64 of ``index.count``: each gradient's local squared norm times its share, 0 where it has none.

    Summed over ranks (one all-reduce), entry ``i`` is the global squared norm of gradient ``i`` and the sum of all
    entries the global squared total norm (``signals/sharded.py``). Float64, so a squared norm never overflows where
    the norm itself is finite. The layout does not depend on which gradients are present, so every rank's vector
    has the same length.
    """
    out = torch.zeros(index.count, dtype=torch.float64, device=device)
    if norms is None or index.count == 0:
        return out
    squares = norms.tensor_norms.to(device=device, dtype=torch.float64).square()
    shares = index.shares(device) if index.sharded else None
    if norms.present is None:
        return squares * shares if shares is not None else squares
    where = torch.tensor(norms.present, dtype=torch.long, device=device)
    if shares is not None:
        squares = squares * shares.index_select(0, where)
    return out.index_copy_(0, where, squares)


def _norms_fp32(tensors: list[Tensor]) -> list[Tensor] | tuple[Tensor, ...]:
    """Per-tensor 2-norms of one (device, dtype) group, accumulated in float32 (float32/float64: their own)."""
    return _lightning_compat.foreach_norms(tensors, 2, dtypes=_F32, cast=torch.float32)


_F32 = (torch.float32,)
