"""Whether a list of tensors is all finite: one fused pass, the verdict stays a device tensor (no host read)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_nanguard.signals.gradients import _foreach_norm_fp32

__all__ = ["all_finite"]


def all_finite(tensors: Sequence[Tensor], *, wide: bool = False) -> Tensor:
    """0-d bool tensor: every floating-point element of ``tensors`` is finite.

    One ``torch._foreach_norm`` per (device, dtype) group; a 2-norm propagates NaN and inf. Norms accumulate in
    float32, so a large finite fp16 value does not overflow and read as non-finite; ``wide=True`` accumulates in
    float64 (where the device has it), so no finite value however large (3e38 in float32) reads as overflow: for
    incident paths, where that certainty is worth the slower pass. Complex tensors are checked through their real
    view; integer and boolean tensors cannot hold NaN and are ignored.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for t in tensors:
        if t.is_complex():  # a complex NaN is a NaN in its real or imaginary part
            t = torch.view_as_real(t)
        if t.is_floating_point() and t.numel() > 0:
            groups[(t.device, t.dtype)].append(t.detach())
    if not groups:
        return torch.tensor(True)
    device = next(iter(groups))[0]
    norm = _foreach_norm_wide if wide else _foreach_norm_fp32
    norms = [n.to(device) for group in groups.values() for n in norm(group)]
    return torch.isfinite(torch.stack(norms)).all()


def _foreach_norm_wide(tensors: list[Tensor]) -> list[Tensor]:
    for dtype in (torch.float64, torch.float32):  # float64 is missing on some backends (MPS)
        try:
            return list(torch._foreach_norm(tensors, 2, dtype=dtype))
        except (TypeError, RuntimeError):
            continue
    return [n.float() for n in torch._foreach_norm(tensors, 2)]  # older torch without dtype=
