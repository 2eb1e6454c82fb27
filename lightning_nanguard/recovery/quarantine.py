"""Quarantine: data that caused an incident is skipped when it comes back, without a new incident.

Two keys, the best one available:

* **sample indices** (map-style datasets with a ``BatchSampler``, single device or DDP): the batch sampler's output
  is recorded in the main process, so the dataset index of every row of every training batch is known on the host
  at no device cost. A quarantined index is then replaced by another index of the same batch before the batch is
  loaded, so the bad sample never reaches the model again and the batch keeps its shape.
* **batch fingerprints** (iterable datasets, custom batch samplers): a digest of the batch's tensors; while any
  fingerprint is quarantined, every batch is fingerprinted at batch start (one host read per step then) and a
  matching batch's update is dropped without an incident.

The quarantine is identical on every rank (additions are all-gathered), saved in the callback state (so it survives
``fit(ckpt_path=...)``), written to ``<log_dir>/nanguard/quarantine.json``, listed by the summary and ``nanguard
report``, and can be seeded from a file (``GradNormMonitor(quarantine_file=...)``).

``BatchSampler.__iter__`` is wrapped (saved and re-assigned) only while a fit with a quarantine runs, because the
first epoch's iterator is created before any training hook; instances record their recent batches in a small ring,
and the training loaders' samplers are attached at each epoch start.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import BatchSampler

from lightning_nanguard import _distributed, _lightning_compat

__all__ = ["Quarantine"]

QUARANTINE_FILE = os.path.join("nanguard", "quarantine.json")
_RING = 512  # batches remembered per sampler before a training hook attaches (prefetch_factor * workers, at most)
_PATCH: dict[str, Any] = {"original": None, "users": 0}


def _patched_iter(self: BatchSampler) -> Iterator[list[int]]:
    original = _PATCH["original"] or BatchSampler.__iter__
    ring = self.__dict__.get("_nanguard_ring")
    if ring is None:
        ring = self.__dict__["_nanguard_ring"] = deque(maxlen=_RING)
    ring.clear()
    hook = self.__dict__.get("_nanguard_hook")
    if hook is not None:
        hook.new_pass()
    for batch in original(self):
        hook = self.__dict__.get("_nanguard_hook")
        if hook is not None:
            batch = hook.filter(batch)
        else:
            ring.append(list(batch))
        yield batch


class _SamplerHook:
    """Attached to one training batch sampler: filters quarantined indices and queues each batch's indices."""

    def __init__(self, quarantine: Quarantine) -> None:
        self.quarantine = quarantine

    def new_pass(self) -> None:
        self.quarantine.queue.clear()

    def filter(self, batch: list[int]) -> list[int]:
        q = self.quarantine
        if q.samples and any(i in q.samples for i in batch):
            healthy = [i for i in batch if i not in q.samples] or q.last_healthy[-1:]
            if healthy:
                replaced = [i if i not in q.samples else healthy[k % len(healthy)] for k, i in enumerate(batch)]
                q.replaced += sum(1 for i in batch if i in q.samples)
                batch = replaced
        else:
            q.last_healthy = batch[-1:]
        q.queue.append(list(batch))
        return batch


class Quarantine:
    """The quarantined samples and batches of one GradNormMonitor."""

    def __init__(self, seed_file: str | None = None) -> None:
        self.samples: set[int] = set()
        self.fingerprints: set[str] = set()
        self.queue: deque[list[int]] = deque()
        self.current: list[int] | None = None  # dataset indices of the current batch's rows, when known
        self.replaced = 0  # quarantined samples replaced in later batches
        self.dropped_batches = 0  # quarantined batches whose update was dropped (fingerprint match)
        self.last_healthy: list[int] = []
        self.seed_file = seed_file
        self._hooks: list[BatchSampler] = []
        self._log_path: str | None = None
        if seed_file is not None:
            self.load_file(seed_file)

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        """Start recording batch samplers (a fit begins)."""
        if _PATCH["users"] == 0:
            _PATCH["original"] = BatchSampler.__iter__
            BatchSampler.__iter__ = _patched_iter  # type: ignore[method-assign]
        _PATCH["users"] += 1

    def detach(self) -> None:
        for sampler in self._hooks:
            sampler.__dict__.pop("_nanguard_hook", None)
        self._hooks.clear()
        self.queue.clear()
        self.current = None
        if _PATCH["users"] > 0:
            _PATCH["users"] -= 1
            if _PATCH["users"] == 0 and _PATCH["original"] is not None:
                BatchSampler.__iter__ = _PATCH["original"]  # type: ignore[method-assign]
                _PATCH["original"] = None

    def attach(self, trainer: pl.Trainer, log_dir: str | None) -> None:
        """Each epoch start: hook the training loaders' batch samplers (adopting what they yielded already).

        ``log_dir`` is the incident sink's (rank 0 only): ``trainer.log_dir`` is a broadcast, a collective that one
        rank must never call alone.
        """
        if self._log_path is None and log_dir:
            self._log_path = os.path.join(log_dir, QUARANTINE_FILE)
        for sampler in _lightning_compat.train_batch_samplers(trainer):
            if not isinstance(sampler, BatchSampler) or sampler.__dict__.get("_nanguard_hook") is not None:
                continue
            hook = _SamplerHook(self)
            ring = sampler.__dict__.get("_nanguard_ring") or ()
            self.queue.clear()
            for batch in ring:  # yielded before this hook existed (the first epoch's prefetch)
                self.queue.append(list(batch))
            sampler.__dict__["_nanguard_hook"] = hook
            self._hooks.append(sampler)

    # ------------------------------------------------------------------ per batch
    @property
    def active(self) -> bool:
        """Something is quarantined: every batch must be checked at its start (``begin_batch``)."""
        return bool(self.samples or self.fingerprints)

    def next_batch(self) -> None:
        """``begin_batch`` while nothing is quarantined (no batch can be dropped): only keep ``current`` in step with
        the batches, called once per batch at any point before its incident is handled (the engine: at its end)."""
        self.current = self.queue.popleft() if self.queue else None

    def begin_batch(self, batch: Any) -> bool:
        """Called at every batch start. True when this batch is quarantined (drop its update, no incident)."""
        self.current = self.queue.popleft() if self.queue else None
        if self.current is not None and self.samples and any(i in self.samples for i in self.current):
            self.dropped_batches += 1  # prefetched before the quarantine knew the sample
            return True
        if self.fingerprints and fingerprint(batch) in self.fingerprints:
            self.dropped_batches += 1
            return True
        return False

    # ------------------------------------------------------------------ incident path
    def add(self, trainer: pl.Trainer, batch: Any, rows: Sequence[int], step: int, *, take: bool = True) -> str:
        """Quarantine the rows of the current batch (all of it when ``rows`` is empty); ``take=False``: nothing from
        this rank. A collective: every rank calls it, and every rank ends with the same quarantine."""
        local: dict[str, Any] = {"samples": [], "fingerprint": ""}
        if not take:
            pass
        elif self.current is not None:
            picked = [self.current[r] for r in rows if 0 <= r < len(self.current)] if rows else list(self.current)
            local["samples"] = picked
        elif batch is not None:
            local["fingerprint"] = fingerprint(batch)
        gathered = _distributed.all_gather_objects(trainer, local)
        new_samples = sorted({int(s) for part in gathered for s in part["samples"]} - self.samples)  # type: ignore[index]
        new_prints = sorted({str(part["fingerprint"]) for part in gathered if part["fingerprint"]} - self.fingerprints)  # type: ignore[index]
        self.samples.update(new_samples)
        self.fingerprints.update(new_prints)
        self._write(step)
        if new_samples:
            return f"quarantined dataset sample(s) {new_samples}: they are replaced when they come back"
        if new_prints:
            return "quarantined this batch (fingerprint; the dataset exposes no sample indices): its update is dropped when it comes back"
        return "the data was already quarantined"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "samples": sorted(self.samples),
            "fingerprints": sorted(self.fingerprints),
            "replaced": self.replaced,
            "dropped_batches": self.dropped_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples.update(int(s) for s in state.get("samples", []))
        self.fingerprints.update(str(f) for f in state.get("fingerprints", []))
        self.replaced = int(state.get("replaced", self.replaced))
        self.dropped_batches = int(state.get("dropped_batches", self.dropped_batches))

    def load_file(self, path: str) -> None:
        """Seed from a JSON file: ``{"samples": [...], "fingerprints": [...]}`` or a plain list of sample indices."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, list):
            data = {"samples": data}
        self.load_state_dict(data)

    def summary_lines(self) -> list[str]:
        if not self.samples and not self.fingerprints:
            return []
        shown = sorted(self.samples)[:10]
        more = f" and {len(self.samples) - 10} more" if len(self.samples) > 10 else ""
        line = f"quarantined: {len(self.samples)} sample(s) {shown}{more}" if self.samples else "quarantined:"
        if self.fingerprints:
            line += f" {len(self.fingerprints)} batch fingerprint(s)"
        line += f"; replaced {self.replaced} time(s), {self.dropped_batches} batch update(s) dropped"
        if self._log_path:
            line += f" (list: {self._log_path})"
        return [line]

    def _write(self, step: int) -> None:
        if self._log_path is None:
            return
        os.makedirs(os.path.dirname(self._log_path), exist_ok=True)
        tmp = self._log_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**self.state_dict(), "step": step}, f, indent=1)
        os.replace(tmp, self._log_path)


def fingerprint(batch: Any) -> str:
    """A digest of a batch's tensors (shapes and a few reductions, read to the host once)."""
    tensors = _tensors(batch)
    if not tensors:
        return ""
    stats = torch.stack(
        [
            torch.stack(
                [t.detach().double().sum(), t.detach().double().abs().sum(), t.detach().double().square().sum()]
            )
            for t in tensors
        ]
    )
    shapes = ";".join(str(tuple(t.shape)) for t in tensors)
    values = ",".join(f"{v:.9g}" for v in stats.reshape(-1).tolist())
    return hashlib.sha1(f"{shapes}|{values}".encode()).hexdigest()[:16]


def _tensors(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []
