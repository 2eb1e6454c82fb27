"""A kept snapshot's weights in the live module for one block, then the current weights back, bit for bit.

The probe's verdict compares like with like: the current weights and the reference snapshot's, scored on the same
rows, under the same objective, at the same moment (``recovery.probe``). The snapshot's parameters and buffers are
copied into the live tensors in place (``SnapshotRing.restore(model_only=True)``: the optimizer state is not
touched), the block runs, and the current ones, copied on the device before, are copied back. Incident path only
(a spike): it costs a device copy of the model, a host-to-device copy of the snapshot's model part and the block.
Under DDP the restore is a collective; every rank enters it together (the probe's ranks agree first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_nanguard import _lightning_compat
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.recovery.snapshot_slot import Snapshot
from lightning_nanguard.recovery.snapshot_state import live_state, model_tensors

__all__ = ["snapshot_weights"]


@contextlib.contextmanager
def snapshot_weights(ring: SnapshotRing, step: int, trainer: pl.Trainer, module: nn.Module) -> Iterator[bool]:
    """The weights of the kept snapshot of ``step`` in ``module`` for the block (yields True), the current ones back
    after it. Yields False (nothing changed) where the ring holds no such snapshot or it does not match the module
    as it is now, tensor for tensor (a reshaped buffer, a materialized lazy layer)."""
    snapshot = ring.get(step)
    if snapshot is None or not _matches(snapshot, module):
        yield False
        return
    live = model_tensors(module)
    with torch.no_grad():
        current = [t.detach().clone() for t in live]
    try:
        ring.restore(snapshot, module, [], trainer, model_only=True)
        yield True
    finally:
        with torch.no_grad():
            _lightning_compat.foreach_copy_(live, current)


def _matches(snapshot: Snapshot, module: nn.Module) -> bool:
    """The snapshot's module entries are the module's tensors now: same names, shapes and dtypes, in order."""
    layout = snapshot.layout
    if layout is None:
        return False
    n = snapshot.n_model
    state = live_state(module, [], set())
    if state.names != tuple(snapshot.names[:n]):
        return False
    specs = [e.spec for e in layout.entries[:n]]
    return all(
        (tuple(t.shape), t.dtype) == (tuple(s.shape), s.dtype) for t, s in zip(state.tensors, specs, strict=True)
    )
