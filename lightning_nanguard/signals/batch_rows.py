"""Which rows of a batch hold a non-finite float: the cheapest evidence that the data is to blame (incident path)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_nanguard.signals.tensors import iter_tensors

__all__ = ["floating_tensors", "nonfinite_rows"]


def floating_tensors(batch: object) -> list[Tensor]:
    """Every floating-point tensor in a (nested) batch, in a stable order (``signals.tensors.iter_tensors``)."""
    return [t for t in iter_tensors(batch) if t.is_floating_point()]


def nonfinite_rows(batch: object) -> list[int]:
    """Indices along the first dimension of the rows that hold a NaN/inf in any float tensor of ``batch``."""
    rows: set[int] = set()
    for t in floating_tensors(batch):
        if t.dim() == 0 or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t.detach().reshape(t.shape[0], -1)).all(dim=1)
        rows.update(int(i) for i in torch.nonzero(bad).reshape(-1).tolist())
    return sorted(rows)
