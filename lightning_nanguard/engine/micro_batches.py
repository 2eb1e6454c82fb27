"""The micro-batches of a gradient-accumulation window, and which one made the step non-finite (incident path).

Under ``accumulate_grad_batches=n`` one optimizer step sums the gradients of ``n`` micro-batches; the batch at hand
when the step is judged is the last one. A NaN from an earlier micro-batch would then be blamed on the last one (or
on nothing). So the engine keeps a reference to each earlier micro-batch of the window (the batch object, its index
and, where the quarantine follows the loaders' samplers, its sample indices: no copy, no device op) and the
micro-batches' own losses, which it keeps anyway; both are read only on the incident path, here.

Lightning steps at batch ``b`` when ``(b + 1) % n == 0`` or at the epoch's last batch, so the window of the step at
batch ``b`` is batches ``n * (b // n)`` to ``b`` of the epoch: older entries of the ring belong to earlier windows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_nanguard.signals.tensors import all_finite, iter_tensors

__all__ = ["MicroBatch", "MicroBatches", "locate"]

SampleIds = dict[str, list[int] | None]
MANUAL_WINDOW = 64  # micro-batches kept of a hand-written accumulation window (manual optimization)


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One micro-batch of a window: the batch, its index in the epoch, its samples per loader (quarantine keys)."""

    batch: object
    batch_idx: int
    epoch: int
    samples: SampleIds | None = None
    step: int = -1  # global_step when it ended (manual optimization: the step its window closes at)


class MicroBatches:
    """The earlier micro-batches of the current accumulation window (references only, the last ``n - 1``)."""

    def __init__(self) -> None:
        self._ring: deque[MicroBatch] = deque(maxlen=1)
        self.manual = False  # a manual-optimization window was remembered (hand-written accumulation)

    def remember_manual(self, entry: MicroBatch) -> None:
        """Manual optimization: a batch ran a backward without an optimizer step. Its window is every such batch
        since the last step (``global_step`` unchanged), at most ``MANUAL_WINDOW``."""
        self.manual = True
        if self._ring.maxlen != MANUAL_WINDOW:
            self._ring = deque(maxlen=MANUAL_WINDOW)
        elif self._ring and (self._ring[-1].step != entry.step or self._ring[-1].epoch != entry.epoch):
            self._ring.clear()
        self._ring.append(entry)

    def manual_window(self, epoch: int, batch_idx: int, step: int) -> list[MicroBatch]:
        """The earlier micro-batches of the hand-written window the step ``step`` closes, oldest first."""
        return [m for m in self._ring if m.step == step and m.epoch == epoch and m.batch_idx < batch_idx]

    def remember(self, entry: MicroBatch, accumulate: int) -> None:
        """A micro-batch ended without an optimizer step: keep a reference to it, and let go of those of earlier
        windows (a window whose step was quick is never looked at)."""
        if self._ring.maxlen != accumulate - 1:
            self._ring = deque(maxlen=max(1, accumulate - 1))
        elif self._ring and not _same_window(self._ring[0], entry, accumulate):
            self._ring.clear()
        self._ring.append(entry)

    def window(self, epoch: int, batch_idx: int, accumulate: int) -> list[MicroBatch]:
        """The earlier micro-batches of the window the step at ``batch_idx`` closes, oldest first."""
        last = MicroBatch(None, batch_idx, epoch)
        return [m for m in self._ring if m.batch_idx < batch_idx and _same_window(m, last, accumulate)]

    def clear(self) -> None:
        self._ring.clear()


def _same_window(a: MicroBatch, b: MicroBatch, accumulate: int) -> bool:
    return a.epoch == b.epoch and a.batch_idx // accumulate == b.batch_idx // accumulate


def locate(window: list[MicroBatch], last: MicroBatch, losses: list[Tensor]) -> tuple[MicroBatch, bool]:
    """The micro-batch to blame: the first whose own loss is non-finite, else the first holding a non-finite value,
    else the last one; and whether one was found so (under DDP, this rank's window may be sound: another rank's is
    not). ``losses`` are the window's micro-batch losses in order (one per backward); they are paired with the
    micro-batches only when there is one for each. Incident path only: one host read per read."""
    batches = [*window, last]
    if len(losses) == len(batches):
        finite = torch.stack([loss.detach().float().reshape(-1)[:1].cpu() for loss in losses]).isfinite()
        bad = [i for i, ok in enumerate(finite.reshape(-1).tolist()) if not ok]
        if bad:
            return batches[bad[0]], True
    for m in window:
        tensors = [t for t in iter_tensors(m.batch) if t.is_floating_point()]
        if tensors and not bool(all_finite(tensors, wide=True)):
            return m, True
    return last, False
