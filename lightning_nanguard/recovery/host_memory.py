"""Host memory for snapshots: page-locked where a GPU copies into it, allocated once, exactly the size asked for;
and forked children kept from freeing the parent's page-locked memory.

**Exact-size pinning.** ``torch.empty(..., pin_memory=True)`` goes through the CUDA caching host allocator, which
rounds every block up to a power of two (a 4.8 GB snapshot slot would pin 8 GB). Like ``torch.distributed.checkpoint``'s
state-dict stager, a buffer here is plain host memory registered with ``cudaHostRegister`` (``torch.cuda.cudart()``):
exactly its size, pinned for the life of the fit, unregistered by ``release``. On CPU the buffer is plain memory,
written once at allocation so that the first snapshot does not page-fault it in inside a training step.

**Forked DataLoader workers.** A worker forked from a process that uses CUDA inherits the parent's objects,
including garbage not yet collected. Python's garbage collector in the worker may then collect a reference cycle
that holds a pinned tensor from the caching host allocator; if a non-blocking copy ever used that tensor, freeing it
records a CUDA event, which a forked child cannot do: the worker dies with ``cudaErrorInitializationError``.
``protect_forked_children`` moves everything a child inherits into the collector's permanent generation at fork
(``gc.freeze``, CPython's advice for fork servers): the child then never collects the parent's garbage (its own
objects are collected as usual), and the parent frees its own pinned memory in its own process.
"""

from __future__ import annotations

import gc
import os
import weakref

import torch
from torch import Tensor

from lightning_nanguard import _lightning_compat

__all__ = ["host_buffer", "protect_forked_children", "release"]

_FORK_GUARD = {"installed": False}


def protect_forked_children() -> None:
    """Install (once per process) the fork hook described in the module docstring."""
    if _FORK_GUARD["installed"] or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(after_in_child=gc.freeze)
    _FORK_GUARD["installed"] = True


def host_buffer(nbytes: int, *, pin: bool) -> Tensor:
    """A 1-d ``uint8`` host buffer of ``nbytes``: registered with CUDA (``pin``, where CUDA is available), else
    written once (its pages resident before the first copy into it)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return buf
    if pin and torch.cuda.is_available():
        protect_forked_children()
        ptr = buf.data_ptr()
        code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # type: ignore[no-untyped-call]  # 1: cudaHostRegisterPortable
        if code != 0:
            raise RuntimeError(
                f"nanguard: cudaHostRegister of a {nbytes}-byte snapshot buffer failed (cudaError {code})."
            )
        # Unregistered by ``release``, or else when the buffer is collected (at most once; in this process only: a
        # forked child must not call CUDA).
        unpin = weakref.finalize(buf, _unregister, ptr, os.getpid())
        unpin.atexit = False  # not at interpreter exit, after the CUDA context may be gone
        _lightning_compat.set_instance_attribute(buf, "_nanguard_unpin", unpin)
    else:
        buf.zero_()
    return buf


def release(buf: Tensor | None) -> None:
    """Unregister ``buf``'s pages if ``host_buffer`` registered them (no copy into it may still be in flight)."""
    if buf is None:
        return
    unpin = _lightning_compat.pop_instance_attribute(buf, "_nanguard_unpin")
    if unpin is not None:
        unpin()


def _unregister(ptr: int, pid: int) -> None:
    if os.getpid() == pid:
        torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
