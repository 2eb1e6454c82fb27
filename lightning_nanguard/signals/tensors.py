"""Whether a list of tensors is all finite: one fused pass, the verdict stays a device tensor (no host read)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_nanguard.signals.gradients import _foreach_norm_fp32

__all__ = ["all_finite"]


def all_finite(tensors: Sequence[Tensor]) -> Tensor:
    """0-d bool tensor: every floating-point element of ``tensors`` is finite.

    One ``torch._foreach_norm`` per (device, dtype) group, accumulated in float32 (a large finite fp16 value must not
    overflow the norm and read as non-finite); a 2-norm propagates NaN and inf. Non-float tensors are ignored.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        if t.is_floating_point() and t.numel() > 0:
            groups[(t.device, t.dtype)].append(t)
    if not groups:
        return torch.tensor(True)
    device = next(iter(groups))[0]
    norms = [n.to(device) for group in groups.values() for n in _foreach_norm_fp32(group)]
    return torch.isfinite(torch.stack(norms)).all()
