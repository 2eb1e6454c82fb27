"""The quarantine's hold on the training batch samplers: it knows which dataset samples each batch holds, and keeps
quarantined samples out of the batches.

``BatchSampler.__iter__`` is wrapped (saved and re-assigned) only while a fit with a quarantine runs, because the
first epoch's iterator is created before any training hook. Each pass over a sampler (one ``__iter__``) is a
generator that, once a ``LoaderHook`` is attached to the sampler:

* **refills**: a quarantined index is left out and the batch is filled with the next healthy indices the sampler
  gives (read ahead from its own order), so every batch keeps its size and holds distinct, healthy samples; at the
  end of the pass the shortfall is filled with the pass's first healthy samples, so the pass yields as many batches
  as it would have (Lightning's batch counts, ``len(dataloader)``, stay true). Only where no healthy sample is left
  in the pass is a batch given as it was (its update is then dropped at the batch start).
* **records** each batch it yields, tagged with its pass, in the hook's queue: the training batch start takes the
  oldest (``LoaderHook.pop``), which is the batch being trained (DataLoader workers and Lightning prefetch batches
  ahead, in order).

Before a hook is attached (the first epoch's prefetch) a pass records into a small ring on the sampler, adopted by
the hook. Entries of a pass that was abandoned unfinished (an epoch cut short, an iterator replaced) are dropped
when the next pass starts; the queue starts afresh at each later epoch start (``LoaderHook.new_epoch``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import BatchSampler

from lightning_nanguard import _lightning_compat

__all__ = ["LoaderHook", "detach", "install_patch", "remove_patch"]

_RING = 512  # batches remembered per sampler before a training hook attaches (prefetch_factor * workers, at most)
_HOOK = "_nanguard_hook"
_RING_ATTR = "_nanguard_ring"
_PATCH: dict[str, Any] = {"original": None, "users": 0}
_NOTHING: frozenset[int] = frozenset()


class _Pass:
    """One ``__iter__`` of a batch sampler; ``finished`` once it yielded its last batch."""

    __slots__ = ("finished",)

    def __init__(self) -> None:
        self.finished = False


class LoaderHook:
    """Attached to one training loader's batch sampler: which samples its batches hold, and which to keep out.

    ``bad`` is the quarantined indices of this loader (set by the quarantine whenever they change); ``on_replaced``
    is told how many quarantined indices a pass left out.
    """

    def __init__(self, on_replaced: Callable[[int], None]) -> None:
        self.bad: frozenset[int] = _NOTHING
        self.on_replaced = on_replaced
        self.queue: deque[tuple[_Pass, list[int]]] = deque()

    def adopt(self, sampler: BatchSampler) -> None:
        """Attach to ``sampler``, taking over what it yielded before (the first epoch's prefetch)."""
        ring = _lightning_compat.instance_attribute(sampler, _RING_ATTR)
        if ring:
            self.queue.extend(ring)
            ring.clear()
        _lightning_compat.set_instance_attribute(sampler, _HOOK, self)

    def attached_to(self, sampler: BatchSampler) -> bool:
        return _lightning_compat.instance_attribute(sampler, _HOOK) is self

    def new_epoch(self) -> None:
        """An epoch starts (its iterator is created after this): nothing queued belongs to it."""
        self.queue.clear()

    def new_pass(self) -> None:
        """A pass starts: what an abandoned earlier pass queued will never be trained."""
        if any(not p.finished for p, _ in self.queue):
            self.queue = deque(entry for entry in self.queue if entry[0].finished)


def detach(sampler: BatchSampler) -> None:
    """Let ``sampler`` go (the fit ends): no hook, nothing remembered."""
    _lightning_compat.pop_instance_attribute(sampler, _HOOK)
    ring = _lightning_compat.instance_attribute(sampler, _RING_ATTR)
    if ring is not None:
        ring.clear()


def install_patch() -> None:
    """Wrap ``BatchSampler.__iter__`` (one wrap however many fits run)."""
    if _PATCH["users"] == 0:
        _PATCH["original"] = BatchSampler.__iter__
        BatchSampler.__iter__ = _patched_iter  # type: ignore[method-assign]
    _PATCH["users"] += 1


def remove_patch() -> None:
    if _PATCH["users"] > 0:
        _PATCH["users"] -= 1
        if _PATCH["users"] == 0 and _PATCH["original"] is not None:
            BatchSampler.__iter__ = _PATCH["original"]  # type: ignore[method-assign]
            _PATCH["original"] = None


def _patched_iter(self: BatchSampler) -> Iterator[list[int]]:
    original = _PATCH["original"] or BatchSampler.__iter__
    ring = self.__dict__.get(_RING_ATTR)
    if ring is None:
        ring = self.__dict__[_RING_ATTR] = deque(maxlen=_RING)
    ring.clear()
    this_pass = _Pass()
    hook = self.__dict__.get(_HOOK)
    if hook is not None:
        hook.new_pass()
    source = iter(original(self))
    stream = _Refill(source)
    while True:
        hook = self.__dict__.get(_HOOK)
        bad = hook.bad if hook is not None else _NOTHING
        # Nothing to leave out and nothing read ahead (every healthy step): the batch as the sampler gives it.
        batch = stream.next(bad) if bad or stream.sizes else next(source, None)
        if batch is None:
            break
        if hook is None:
            ring.append((this_pass, batch))
        else:
            hook.queue.append((this_pass, batch))
            if stream.replaced:
                hook.on_replaced(stream.replaced)
                stream.replaced = 0
        yield batch
    this_pass.finished = True


class _Refill:
    """One pass's batches with the quarantined indices replaced by the next healthy ones (see the module docstring).

    Read-ahead state: ``sizes`` and ``originals`` of batches read but not yet given, ``pool`` their healthy indices;
    ``head`` the pass's first healthy indices given (as many as a refill at the end can need).
    """

    __slots__ = ("done", "head", "originals", "pool", "recycled", "replaced", "sizes", "source")

    def __init__(self, source: Iterator[list[int]]) -> None:
        self.source = source
        self.sizes: deque[int] = deque()
        self.originals: deque[list[int]] = deque()
        self.pool: deque[int] = deque()
        self.head: list[int] = []
        self.replaced = 0
        self.recycled = 0  # head samples given again so far (the next refill goes on from there)
        self.done = False

    def next(self, bad: frozenset[int]) -> list[int] | None:
        if not self.sizes:
            if self.done:
                return None
            batch = next(self.source, None)
            if batch is None:
                self.done = True
                return None
            if not bad or bad.isdisjoint(batch):  # the common case: the batch as the sampler gave it
                if bad and len(self.head) < len(bad) + len(batch):
                    self.head.extend(batch)
                return batch
            self._take(list(batch), bad)
        need = self.sizes[0]
        while len(self.pool) < need and self._pull(bad):
            pass
        self.sizes.popleft()
        original = self.originals.popleft()
        if len(self.pool) >= need:
            out = [self.pool.popleft() for _ in range(need)]
        else:  # the pass is spent: its first healthy samples fill the shortfall
            out = list(self.pool)
            self.pool.clear()
            spare = [i for i in self.head if i not in bad]
            if not spare and not out:
                self.replaced -= sum(1 for i in original if i in bad)
                return original  # nothing healthy left in this pass: given as it was, its update is dropped
            spare = spare or out
            short = need - len(out)
            out += [spare[(self.recycled + k) % len(spare)] for k in range(short)]
            self.recycled += short
        if len(self.head) < len(bad) + need:
            self.head.extend(out)
        return out

    def _pull(self, bad: frozenset[int]) -> bool:
        if self.done:
            return False
        batch = next(self.source, None)
        if batch is None:
            self.done = True
            return False
        self._take(list(batch), bad)
        return True

    def _take(self, batch: list[int], bad: frozenset[int]) -> None:
        self.sizes.append(len(batch))
        self.originals.append(batch)
        healthy = [i for i in batch if i not in bad]
        self.replaced += len(batch) - len(healthy)
        self.pool.extend(healthy)
