"""The largest |value| of each parameter a snapshot holds: the reference finite damage is judged against.

Read on the incident path only (``engine.state_growth``), from the host copy the ring already keeps: nothing is added
to a healthy step or to taking a snapshot. Under DDP a parameter spread over the ranks' chunks (a shared entry) is
read piece by piece, each rank its own; the caller reduces them with a maximum.
"""

from __future__ import annotations

import torch

from lightning_nanguard.recovery.snapshot_layout import SHARED
from lightning_nanguard.recovery.snapshot_slot import Snapshot

__all__ = ["parameter_max_abs"]


@torch.no_grad()
def parameter_max_abs(snapshot: Snapshot, names: set[str]) -> dict[str, float]:
    """``{name: largest |value|}`` of the floating entries among ``names`` this rank holds of ``snapshot``."""
    snapshot.wait()
    layout = snapshot.layout
    out: dict[str, float] = {}
    if layout is None or snapshot.flat is None:
        return out

    def fold(name: str, t: torch.Tensor) -> None:
        if t.numel() and t.is_floating_point():
            out[name] = max(out.get(name, 0.0), float(t.detach().abs().amax().float()))

    for i in range(snapshot.n_model):
        name = snapshot.names[i] if i < len(snapshot.names) else ""
        if name not in names or layout.entries[i].region == SHARED:
            continue
        fold(name, snapshot.view(i))
    if layout.sharded:
        for p in layout.pieces(*layout.own_range()):
            if p.index < snapshot.n_model and snapshot.names[p.index] in names:
                spec = layout.entries[p.index].spec
                if spec.dtype.is_floating_point:
                    fold(snapshot.names[p.index], snapshot.flat[p.pos : p.pos + p.end - p.start].view(spec.dtype))
    return out
