"""A snapshot's device-to-host copy on a side CUDA stream, overlapping the next forward and backward.

The copy must read the state as it was when the snapshot was taken, so it must finish reading before anything
writes that state again:

* **parameters and optimizer state** are written by the optimizer's update. The side stream first waits for the
  training stream (everything queued so far, the last update included), copies, and records an event. Each
  optimizer's next update waits for that event on the GPU (``wait_event``: no host sync), through an optimizer step
  pre-hook: where Lightning runs the forward and backward inside ``optimizer.step(closure)``, the hook wraps the
  closure so that the wait comes after the backward and before the update, and the copy overlaps the forward and
  backward. The source tensors are marked in use by the side stream (``record_stream``), so that memory freed
  meanwhile is not reused before the copy has read it;
* **buffers** are written by the forward itself (BatchNorm statistics, DDP's buffer broadcast), so they are copied
  on the training stream, before the forward, in stream order (no host sync either; they are small);
* **host tensors** (such as an optimizer's step counts) are copied at once.

A copy is then complete when its event is: ``ready`` asks without waiting, ``wait`` blocks, and only a restore (or
a finiteness check of the snapshot, on the rollback path) waits. This is the pattern of torchtitan's asynchronous
checkpoint staging (``DefaultStager``: non-blocking copies into pinned memory on a stream of their own, and the
training loop waiting for them just before the optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_nanguard import _lightning_compat

__all__ = ["SideCopy"]

Pairs = tuple[list[Tensor], list[Tensor]]  # (destinations, sources)


class SideCopy:
    """Side-stream copies on ``device`` and the wait before each optimizer update (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.pending: Any = None  # the last copy's event while the optimizers' next update must wait for it
        self._handles: list[Any] = []

    def watch(self, optimizers: Sequence[Optimizer]) -> None:
        """Hook every optimizer's step (a pre-hook that returns at once while no copy is pending)."""
        self.unwatch()
        self._handles = [opt.register_step_pre_hook(self._before_update) for opt in optimizers]

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def start(self, host: Pairs, buffers: Pairs, state: Pairs) -> Any:
        """Queue the copies (host sources now; ``buffers`` on the training stream; ``state`` on the side stream) and
        return the event that completes them all."""
        if host[0]:
            _lightning_compat.foreach_copy_(host[0], host[1])
        current = torch.cuda.current_stream(self.device)
        if buffers[0]:
            _lightning_compat.foreach_copy_(buffers[0], buffers[1], non_blocking=True)
        self.stream.wait_stream(current)  # after the last update and the buffers' copy
        with torch.cuda.stream(self.stream):
            if state[0]:
                _lightning_compat.foreach_copy_(state[0], state[1], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        for src in state[1]:
            src.record_stream(self.stream)
        self.pending = event
        return event

    def wait_all(self) -> None:
        """Block until every copy queued so far is complete (a restore is about to write the live state)."""
        event, self.pending = self.pending, None
        if event is not None:
            event.synchronize()

    def _before_update(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        event = self.pending
        if event is None:
            return None
        if event.query():  # done already (no host sync): nothing to wait for from now on
            self.pending = None
            return None
        if kwargs.get("closure") is not None:
            kwargs = {**kwargs, "closure": self._then_wait(kwargs["closure"], event)}
            return args, kwargs
        # ``args`` starts with the optimizer itself (torch passes ``step``'s own arguments); a closure follows it.
        at = next((k for k, a in enumerate(args) if a is not optimizer and callable(a)), None)
        if at is not None:
            return (*args[:at], self._then_wait(args[at], event), *args[at + 1 :]), kwargs
        self._wait(event)
        return None

    def _then_wait(self, closure: Callable[[], Any], event: object) -> Callable[[], Any]:
        def closure_then_wait() -> Any:
            out = closure()
            self._wait(event)
            return out

        return closure_then_wait

    def _wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)
