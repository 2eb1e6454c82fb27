"""One optimizer step's health as host values (``Reading``), and how they come back from the reduced step vector.

The step vector is ``[grad norm, loss, (scale), *buffer maxes]`` (or, on the inline layout, the per-tensor norms
first, ``[norm_0, ..., norm_k-1, loss, ...]``; or squared norms under sharding). ``fill`` turns its values into the
reading's host floats; on the device path the vector is copied into a pinned ``HostMirror`` and ``resolve`` fills
the reading at the batch end, once an earlier synchronization has made the copy free to read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol, cast

import torch
from torch import Tensor

from lightning_nanguard.contract import Signal
from lightning_nanguard.recovery.host_memory import protect_forked_children
from lightning_nanguard.signals.gradients import GradNorms, ParamIndex

__all__ = ["DropPath", "HostMirror", "Layout", "Pending", "Reading", "StateBefore", "fill", "resolve"]


class _HostBuffer(Protocol):
    """A tensor marked as host memory a device vector was copied into (``_lightning_compat.host_buffer_marked``)."""

    _nanguard_host: bool


class DropPath(str, Enum):
    """How an optimizer's update is dropped, and so how its step's verdict reaches it."""

    HOST = "host"  # read on the host before the step; a drop sets the gradients to None
    SCALER = "scaler"  # a GradScaler is active: the verdict is ORed into its found_inf
    FUSED = "fused"  # a fused optimizer that takes found_inf: the verdict is its flag


# A bad step's state check, taken before its update: (finite, the non-finite tensors' names).
StateBefore = tuple[bool, list[str]]


@dataclass(slots=True)
class Reading:
    """The health of one optimizer step, as host values identical on every rank (after the reduction).

    Attributes:
        step: ``trainer.global_step`` of the step (before its update).
        optimizer_idx: which optimizer (manual optimization can step several per batch).
        batch: the training batch counter, to tie the reading to its batch.
        grad_norm: total unscaled pre-clip 2-norm of the gradients (mean over ranks; NaN/inf when non-finite).
        loss: mean over ranks of the unscaled step loss; ``None`` when no loss was seen (no backward).
        scale: the GradScaler scale the step ran with, or ``None``.
        has_grads: any gradient was present.
        norms: the device-side per-tensor norms (per-layer norms, forensics); ``None`` when no gradient.
        index: the parameters the norms are of.
        local: this rank's own ``[grad norm, loss]`` device vector, for the incident path's per-rank attribution.
        device_skipped: the update was dropped on the device (device path, non-finite verdict).
        buffers_finite: the module's watched buffers (``signals.model_tensors.watched_buffers``) were finite.
        inline: ``local`` (and the reduced vector) start with this many per-tensor norms instead of the total.
        dropped: the update was dropped (by nanguard or the GradScaler), filled in by the engine.
        spike: the spike this step was judged to be, filled in by the engine.
        path: how this optimizer drops an update.
        pending: device path only, until the batch end: what ``resolve`` needs to fill the host values.
        zscores: a spike's z-scores.
        state_before: a bad step (incident path): the state as it was before the update.
        lr: a spike's step: the learning rate it ran with (the first param group's, read before the scheduler
            steps); ``None`` elsewhere.
    """

    step: int
    optimizer_idx: int
    batch: int
    grad_norm: float
    loss: float | None
    scale: float | None
    has_grads: bool
    norms: GradNorms | None
    index: ParamIndex
    local: Tensor | None = None
    device_skipped: bool = False
    buffers_finite: bool = True
    inline: int = 0
    dropped: bool = False
    spike: Signal | None = None
    path: DropPath = DropPath.HOST
    pending: Pending | None = None
    zscores: dict[str, float] | None = None
    state_before: StateBefore | None = None
    lr: float | None = None

    @property
    def loss_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)

    @property
    def grads_finite(self) -> bool:
        return math.isfinite(self.grad_norm)

    @property
    def bad(self) -> bool:
        """The step is non-finite on some rank (loss, gradients or a watched buffer). Read several times per step:
        written out rather than through ``grads_finite``/``loss_finite``."""
        loss = self.loss
        return not (self.buffers_finite and math.isfinite(self.grad_norm) and (loss is None or math.isfinite(loss)))


class Layout(NamedTuple):
    """Where the host values sit in a reduced step vector."""

    world: int  # ranks summed into it (the loss and scale are divided by it; a plain norm too)
    has_loss: bool
    has_scale: bool
    probes: int = 0  # buffer-max entries after the loss (and scale)
    squared: bool = False  # the first entry is the global squared norm (sharded), already weighted by shares


class HostMirror:
    """A small host buffer the device vector is copied into without a synchronization (pinned, non-blocking).

    Reading it is free once the copy has completed: after any later synchronization (the GradScaler's own
    ``found_inf`` read), or when its CUDA event reports completion. On CPU the copy is synchronous.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            protect_forked_children()  # a forked DataLoader worker must never free this buffer (host_memory.py)
        self.buffer = torch.empty(size, dtype=torch.float64, pin_memory=self.cuda)
        cast(_HostBuffer, self.buffer)._nanguard_host = True  # a host buffer: reading it is no device read
        self.array = self.buffer.numpy()  # the same memory: ``values`` reads it with no tensor op
        self.event: torch.cuda.Event | None = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
        self.size = size
        self._views: dict[int, Tensor] = {}  # n -> buffer[:n], made once

    def fill(self, vec: Tensor) -> None:
        n = vec.numel()
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.buffer[:n]
        # On the CPU ``copy_`` converts to float64 itself; from CUDA the vector is widened on the device first.
        view.copy_(vec.detach().double() if self.cuda else vec.detach(), non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def values(self, n: int) -> list[float]:
        event = self.event
        if event is not None and not event.query():  # type: ignore[no-untyped-call]
            event.synchronize()  # old work only: the step it belongs to has been queued long ago
        return self.array[:n].tolist()


class Pending(NamedTuple):
    """A device-path reading's vector, copied to the host and read at the batch end."""

    mirror: HostMirror
    n: int
    layout: Layout


def resolve(reading: Reading) -> bool:
    """Fill a device-path reading from its host mirror. True if it was pending."""
    pending = reading.pending
    if pending is None:
        return False
    reading.pending = None
    fill(reading, pending.mirror.values(pending.n), pending.layout)
    reading.device_skipped = reading.bad
    return True


def fill(reading: Reading, values: list[float], layout: Layout) -> None:
    """Host values from the reduced vector ``[grad norm, loss, (scale), *buffer maxes]``, or with ``reading.inline``
    norms first, ``[norm_0, ..., norm_k-1, loss, ...]`` (the total is summed here)."""
    if reading.inline:
        k = reading.inline
        squares = 0.0
        for v in values[:k]:
            squares += v * v
        values = [math.sqrt(squares), *values[k:]]
    world = layout.world
    if layout.squared:
        # Already global (shares weighted): no division by the world size. NaN stays NaN; +inf stays +inf.
        values = [math.sqrt(values[0]) if values[0] >= 0 else math.nan, *values[1:]]
        grad_norm = values[0]
    else:
        grad_norm = values[0] / world
    loss = values[1] / world
    scale = values[2] / world if layout.has_scale else None
    if scale is not None and scale > 0 and math.isfinite(scale):
        loss = loss / scale  # on_before_backward saw the scaled loss
    reading.grad_norm = grad_norm if reading.has_grads else 0.0
    reading.loss = loss if layout.has_loss else None
    reading.scale = scale
    if layout.probes:
        start = 3 if layout.has_scale else 2
        reading.buffers_finite = math.isfinite(sum(values[start : start + layout.probes]))
    if not reading.has_grads and not math.isfinite(values[0]):
        reading.grad_norm = values[0]  # another rank's gradients were non-finite
