"""Tensors in nested containers: the one walker over a batch (``iter_tensors``), and whether a list of tensors is
all finite (one fused pass, the verdict stays a device tensor: no host read)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard import _lightning_compat
from lightning_nanguard.signals.stored import stored_values

__all__ = ["all_finite", "at_path", "fingerprint", "iter_tensors"]


def iter_tensors(obj: object) -> Iterator[Tensor]:
    """Every tensor of a (nested) batch, depth first, in a stable order: tensors, mappings (in their order), lists
    and tuples (named tuples too) and dataclass instances (in field order), as Lightning's ``apply_to_collection``
    walks them. Anything else (strings, numbers, ``None``) holds no tensor."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None))


def at_path(obj: object, path: Sequence[Any]) -> object:
    """The part of a nested batch at ``path`` (mapping keys and sequence positions, outermost first); ``None`` where
    the batch has no such part. ``()`` is the batch itself."""
    for part in path:
        if isinstance(obj, Mapping):
            obj = obj.get(part)
        elif isinstance(obj, (list, tuple)) and isinstance(part, int) and 0 <= part < len(obj):
            obj = obj[part]
        else:
            return None
    return obj


def fingerprint(batch: object) -> str:
    """A digest of a batch's tensors (shapes and a few reductions, read to the host once): the quarantine's key for
    a batch without sample indices."""
    tensors = [torch.view_as_real(t) if t.is_complex() else t for t in iter_tensors(batch)]
    if not tensors:
        return ""
    stats = torch.stack(
        [
            torch.stack(
                [t.detach().double().sum(), t.detach().double().abs().sum(), t.detach().double().square().sum()]
            )
            for t in tensors
        ]
    )
    shapes = ";".join(str(tuple(t.shape)) for t in tensors)
    values = ",".join(f"{v:.9g}" for v in stats.reshape(-1).tolist())
    return hashlib.sha1(f"{shapes}|{values}".encode()).hexdigest()[:16]


def all_finite(tensors: Sequence[Tensor], *, wide: bool = False) -> Tensor:
    """0-d bool tensor: every floating-point element of ``tensors`` is finite.

    One ``torch._foreach_norm`` per (device, dtype) group; a 2-norm propagates NaN and inf. Norms accumulate in
    float32, so a large finite fp16 value does not overflow and read as non-finite; ``wide=True`` accumulates in
    float64 (where the device has it), so no finite value however large (3e38 in float32) reads as overflow: for
    incident paths, where that certainty is worth the slower pass. Each tensor is read as ``stored_values`` reads it
    (complex: the real view; sparse: its stored values; a lazy module's uninitialized tensor: left out); integer and
    boolean tensors cannot hold NaN and are ignored.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        t = stored_values(tensor)
        if t is not None and t.is_floating_point() and t.numel() > 0:
            groups[(t.device, t.dtype)].append(t.detach())
    if not groups:
        return torch.tensor(True)
    device = next(iter(groups))[0]
    dtypes = (torch.float64, torch.float32) if wide else (torch.float32,)  # no float64 on MPS
    cast = None if wide else torch.float32
    norms = [
        n.to(device)
        for group in groups.values()
        for n in _lightning_compat.foreach_norms(group, 2, dtypes=dtypes, cast=cast)
    ]
    return torch.isfinite(torch.stack(norms)).all()
