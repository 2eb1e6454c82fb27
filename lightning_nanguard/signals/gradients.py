"""One fused pass over the gradients: total norm, per-tensor norms, non-finite count. No host read.

The per-tensor 2-norms come from a single ``torch._foreach_norm`` per (device, dtype) group, accumulated in
float32 so that a large but finite fp16/bf16 gradient does not overflow to inf and read as non-finite. A 2-norm
propagates NaN and inf, so a tensor holding either has a non-finite norm: the non-finite count and the total norm
fall out of the same pass (PERFORMANCE.md, variant e/g: 1.3-1.7x one read of the gradients).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["GradReading", "ParamIndex", "grad_reading", "layer_norms"]


@dataclass(frozen=True)
class GradReading:
    """The gradient health of one optimizer step. Every field is a tensor on the gradients' device."""

    total_norm: Tensor  # 0-d float32, unscaled 2-norm of all gradients (NaN/inf if any element is)
    nonfinite: Tensor  # 0-d int64, number of gradient tensors holding a NaN or inf
    tensor_norms: Tensor  # 1-d float32, one norm per gradient tensor, in ``ParamIndex.present`` order
    present: tuple[int, ...]  # indices (into ParamIndex.params) of the parameters that had a gradient


class ParamIndex:
    """The parameters of one optimizer, their names and their layer groups, built once and reused every step.

    Args:
        params: the optimizer's parameters, in param-group order.
        names: parameter name for each parameter (``""`` when unknown).
        depth: module depth at which parameters are grouped into layers (``1``: top-level children).
    """

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], depth: int) -> None:
        self.params = list(params)
        self.names = list(names)
        self.groups = [layer_of(name, depth) for name in self.names]
        self.layer_names = sorted(set(self.groups))
        position = {name: i for i, name in enumerate(self.layer_names)}
        self.layer_ids = [position[g] for g in self.groups]
        self._index_cache: dict[tuple[int, ...], Tensor] = {}

    def layer_index(self, present: tuple[int, ...], device: torch.device) -> Tensor:
        """The layer id of each present gradient, as a tensor cached per set of present parameters."""
        key = present
        cached = self._index_cache.get(key)
        if cached is None or cached.device != device:
            cached = torch.tensor([self.layer_ids[i] for i in present], dtype=torch.long, device=device)
            if len(self._index_cache) > 8:  # the set of present grads is almost always stable; bound the cache
                self._index_cache.clear()
            self._index_cache[key] = cached
        return cached


def layer_of(name: str, depth: int) -> str:
    """The module path of parameter ``name`` cut at ``depth`` (``"encoder.layers.0.w"``, 2 -> ``"encoder.layers"``)."""
    if not name:
        return "<unnamed>"
    module_path = name.split(".")[:-1]
    if not module_path:
        return "<root>"
    return ".".join(module_path[:depth])


def grad_reading(index: ParamIndex, scale: Tensor | None = None) -> GradReading | None:
    """Read the current gradients of ``index.params`` in one fused pass. ``None`` when no parameter has a gradient.

    Args:
        index: the parameters to read.
        scale: divide the norms by this (0-d tensor), for gradients that are still loss-scaled.
    """
    present: list[int] = []
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    grads: list[Tensor] = []
    for i, p in enumerate(index.params):
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce()._values()
        by_key[(g.device, g.dtype)].append(len(grads))
        grads.append(g)
        present.append(i)
    if not grads:
        return None
    device = grads[0].device
    norms: list[Tensor | None] = [None] * len(grads)
    for positions in by_key.values():
        group = [grads[j] for j in positions]
        for j, n in zip(positions, _foreach_norm_fp32(group), strict=True):
            norms[j] = n
    present_norms = [n for n in norms if n is not None]
    if len(by_key) > 1:  # several devices/dtypes: gather the norms on the first gradient's device
        present_norms = [n.to(device) for n in present_norms]
    stacked = torch.stack(present_norms)
    if scale is not None:
        stacked = stacked / scale.to(device=device, dtype=stacked.dtype)
    total = torch.linalg.vector_norm(stacked, 2)
    nonfinite = (~torch.isfinite(stacked)).sum()
    return GradReading(total_norm=total, nonfinite=nonfinite, tensor_norms=stacked, present=tuple(present))


def layer_norms(index: ParamIndex, reading: GradReading) -> tuple[list[str], Tensor]:
    """Per-layer 2-norms from a reading's per-tensor norms: one ``index_add_`` on the device, no host read.

    Returns the names of the layers that had a gradient and a 1-d tensor of their norms, in the same order, so the
    caller ships all of them to the host with a single ``.tolist()``.
    """
    device = reading.tensor_norms.device
    ids = index.layer_index(reading.present, device)
    squares = torch.zeros(len(index.layer_names), dtype=reading.tensor_norms.dtype, device=device)
    squares.index_add_(0, ids, reading.tensor_norms.square())
    seen = sorted({index.layer_ids[i] for i in reading.present})
    return [index.layer_names[k] for k in seen], squares[seen].sqrt()


def _foreach_norm_fp32(tensors: list[Tensor]) -> Iterable[Tensor]:
    """Per-tensor 2-norms of one (device, dtype) group, accumulated in float32."""
    if tensors[0].dtype in (torch.float32, torch.float64):
        return torch._foreach_norm(tensors, 2)  # already accumulates in float32; dtype= would cost a conversion
    try:
        return torch._foreach_norm(tensors, 2, dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch without dtype=; correct but may overflow for huge fp16 grads
        return [n.float() for n in torch._foreach_norm(tensors, 2)]
