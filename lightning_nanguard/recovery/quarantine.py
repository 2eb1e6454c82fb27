"""Quarantine: data that caused an incident is kept out when it comes back, without a new incident.

Two keys, the best one available:

* **(training loader, sample index)** (map-style datasets loaded through a ``BatchSampler``, single device or DDP):
  the batch sampler's output is recorded in the main process, so the dataset index of every row of every training
  batch is known on the host at no device cost (``quarantine_sampler``). A quarantined sample is left out of later
  batches, which are refilled with the next healthy samples the sampler gives; the batches keep their size and
  number. Several training loaders (``{"a": loader_a, "b": loader_b}``) each have their own indices, and the rows
  of a batch are mapped to samples loader by loader, also through a collate function that reorders them
  (``quarantine_rows``).
* **batch fingerprints** (iterable datasets, custom batch samplers, anything without sample indices): a digest of
  the batch's tensors; while any fingerprint is quarantined, every batch is fingerprinted at its start (one host
  read per step then) and a matching batch's update is dropped.

A quarantined batch that comes back (a fingerprint match, or samples a prefetched batch already held) has its update
dropped, counted (``dropped_batches``) and recorded in the quarantine file, but is no new incident. Under DDP the
ranks agree on that drop with one reduction per batch, and only while something is quarantined: every rank drops
the update or none does.

The quarantine is identical on every rank (additions are all-gathered), kept for one fit (a callback reused by
another Trainer starts empty; ``quarantine_file`` is the way to carry it), saved in the callback state (so it
survives ``fit(ckpt_path=...)``), written to ``<log_dir>/nanguard/quarantine.json`` after each change and at the end
of fit, listed by the summary, and can be seeded from a file (``GradNormMonitor(quarantine_file=...)``; the format
and its validation: ``quarantine_file``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.exceptions import CheckpointVerificationError
from lightning_nanguard.recovery import quarantine_file, quarantine_sampler
from lightning_nanguard.recovery.quarantine_file import EVERY_LOADER, QuarantineRecord
from lightning_nanguard.recovery.quarantine_rows import TrainLoader, samples_of_rows
from lightning_nanguard.recovery.quarantine_sampler import LoaderHook
from lightning_nanguard.signals.tensors import fingerprint

__all__ = ["QUARANTINE_FILE", "Added", "Quarantine", "fingerprint"]

QUARANTINE_FILE = os.path.join("nanguard", "quarantine.json")


@dataclass(frozen=True)
class Added:
    """What one ``Quarantine.add`` quarantined: the sentence for the incident, the samples and fingerprints new."""

    message: str
    samples: list[tuple[str, int]]
    prints: list[str]


class Quarantine:
    """The quarantined samples and batches of one GradNormMonitor, for one fit at a time."""

    def __init__(self, seed_file: str | None = None) -> None:
        self.seed_file = seed_file
        # Read (and validated) here, at construction: a broken file is refused before any training.
        self._seed = quarantine_file.read_file(seed_file) if seed_file is not None else QuarantineRecord()
        self._record = copy.deepcopy(self._seed)
        self._loaders: list[TrainLoader] = []
        self._hooks: dict[str, LoaderHook] = {}
        self._hook_items: list[tuple[str, LoaderHook]] = []
        self._samplers: list[BatchSampler] = []
        self._bad: dict[str, frozenset[int]] = {}
        self.current: dict[str, list[int] | None] = {}  # this batch's dataset indices, per hooked loader
        self._log_path: str | None = None
        self._dirty = False

    # ------------------------------------------------------------------ what is quarantined
    @property
    def samples(self) -> set[int]:
        """The quarantined sample indices, over every loader."""
        return set().union(*self._record.samples.values()) if self._record.samples else set()

    def samples_of(self, batch: object, rows: list[int]) -> set[int]:
        """The dataset indices behind ``rows`` of the current ``batch``, where they are known."""
        picked, _ = samples_of_rows(batch, rows, self._loaders, self.current)
        return {int(i) for _, i in picked}

    @property
    def fingerprints(self) -> set[str]:
        return self._record.fingerprints

    @property
    def replaced(self) -> int:
        """Quarantined samples left out of later batches (and replaced by healthy ones)."""
        return self._record.replaced

    @property
    def dropped_batches(self) -> int:
        """Quarantined batches that came back and whose update was dropped."""
        return self._record.dropped_batches

    @property
    def active(self) -> bool:
        """Something is quarantined: every batch must be checked at its start (``begin_batch``)."""
        return bool(self._record.fingerprints) or any(self._record.samples.values())

    def _bad_of(self, key: str) -> frozenset[int]:
        found = self._bad.get(key)
        if found is None:
            samples = self._record.samples
            found = self._bad[key] = frozenset(samples.get(key, set()) | samples.get(EVERY_LOADER, set()))
        return found

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        """A fit begins: start from the seed file alone (nothing of an earlier fit), record the batch samplers."""
        self._record = copy.deepcopy(self._seed)
        self._bad.clear()
        self._refresh_hooks()
        self._log_path = None
        self._dirty = False
        quarantine_sampler.install_patch()

    def detach(self) -> None:
        """The fit ends: the file as it stands now, and the samplers let go."""
        self._flush(force=True)
        for sampler in self._samplers:
            quarantine_sampler.detach(sampler)
        self._samplers.clear()
        self._hooks.clear()
        self._hook_items = []
        self._loaders.clear()
        self.current = {}
        quarantine_sampler.remove_patch()

    def attach(self, trainer: pl.Trainer, log_dir: str | None) -> None:
        """Each epoch start: hook the training loaders' batch samplers (adopting what they yielded already).

        ``log_dir`` is the incident sink's (rank 0 only): ``trainer.log_dir`` is a broadcast, a collective that one
        rank must never call alone.
        """
        if self._log_path is None and log_dir:
            self._log_path = os.path.join(log_dir, QUARANTINE_FILE)
            self._dirty = self._dirty or self.active
        found = _lightning_compat.train_loaders(trainer)
        self._loaders = []
        samplers = [getattr(loader, "batch_sampler", None) for _, loader in found]
        for (path, loader), sampler in zip(found, samplers, strict=True):
            if not isinstance(loader, DataLoader):
                continue
            key = ".".join(str(p) for p in path)
            self._loaders.append(TrainLoader(key, tuple(path), loader.dataset, loader.collate_fn))
            if (
                not isinstance(sampler, BatchSampler)
                or isinstance(loader.dataset, IterableDataset)  # no sample indices: fingerprints
                or sum(s is sampler for s in samplers) > 1  # one sampler iterated twice per batch: not followed
            ):
                self._hooks.pop(key, None)
                continue
            mine = self._hooks.get(key)
            if mine is not None and mine.attached_to(sampler):
                mine.new_epoch()
                continue
            hook = LoaderHook(on_replaced=self._on_replaced)
            hook.adopt(sampler)
            self._hooks[key] = hook
            self._samplers.append(sampler)
        self._hook_items = list(self._hooks.items())
        self.current = dict.fromkeys(self._hooks)
        self._refresh_hooks()
        self._flush()

    # ------------------------------------------------------------------ per batch
    def next_batch(self) -> None:
        """``begin_batch`` while nothing is quarantined (no batch can be dropped): only keep ``current`` in step with
        the batches, called once per batch at any point before its incident is handled (the engine: at its end)."""
        current = self.current
        for key, hook in self._hook_items:
            queue = hook.queue
            current[key] = queue.popleft()[1] if queue else None

    def begin_batch(self, batch: object, trainer: pl.Trainer | None = None) -> bool:
        """Called at every batch start while the batch start is shown. True when this batch is quarantined: drop its
        update, no incident. Under DDP (``trainer`` given) the ranks agree: one reduction, only while something is
        quarantined, and every rank makes it (the quarantine is identical on every rank)."""
        self.next_batch()
        if not self.active:
            return False
        local = any(ids is not None and not self._bad_of(key).isdisjoint(ids) for key, ids in self.current.items())
        if not local and self._record.fingerprints:
            local = fingerprint(batch) in self._record.fingerprints
        drop = local if trainer is None or trainer.world_size <= 1 else _distributed.any_rank(trainer, local)
        if drop:
            self._record.dropped_batches += 1
            self._touched(trainer.global_step if trainer is not None else None)
        self._flush()
        return drop

    def _on_replaced(self, n: int) -> None:
        self._record.replaced += n
        self._dirty = True

    # ------------------------------------------------------------------ incident path
    def add(
        self,
        trainer: pl.Trainer,
        batch: object,
        rows: Sequence[int],
        step: int,
        *,
        take: bool = True,
        samples: dict[str, list[int] | None] | None = None,
    ) -> Added:
        """Quarantine the rows of the current batch (all of it when ``rows`` is empty); ``take=False``: nothing from
        this rank; ``samples``: the batch's samples per loader where ``batch`` is not the current one (an earlier
        micro-batch of a gradient-accumulation window). A collective: every rank calls it, and every rank ends with
        the same quarantine. Returns what it added (identical on every rank: a blame withdrawn later releases it)
        and the sentence that says so."""
        local: dict[str, Any] = {"samples": [], "fingerprint": "", "note": ""}
        if take:
            current = self.current if samples is None else samples
            try:
                picked, note = samples_of_rows(batch, rows, self._loaders, current)
            except Exception:  # never one rank alone out of the all-gather below: the fingerprint instead
                picked, note = [], ""
            if picked:
                local.update(samples=[[k, i] for k, i in picked], note=note)
            elif batch is not None:
                local["fingerprint"] = fingerprint(batch)
        gathered: list[Any] = _distributed.all_gather_objects(trainer, local)
        known = {(k, i) for k, ids in self._record.samples.items() for i in ids}
        new_samples = sorted({(str(k), int(i)) for part in gathered for k, i in part["samples"]} - known)
        new_prints = sorted({str(p["fingerprint"]) for p in gathered if p["fingerprint"]} - self._record.fingerprints)
        for key, index in new_samples:
            self._record.samples.setdefault(key, set()).add(index)
        self._record.fingerprints.update(new_prints)
        self._changed(step)
        self._flush()
        notes = sorted({str(p["note"]) for p in gathered if p["note"]})
        if new_samples:
            note = f" ({'; '.join(notes)})" if notes else ""
            said = f"quarantined dataset sample(s) {_names(new_samples)}{note}: left out when they come back"
        elif new_prints:
            said = "quarantined this batch (fingerprint; no sample indices): its update is dropped when it comes back"
        elif any(p["samples"] or p["fingerprint"] for p in gathered):
            said = "the data was already quarantined"
        else:
            said = "nothing to quarantine (the batch's samples could not be identified)"
        return Added(said, list(new_samples), list(new_prints))

    def release(self, samples: Sequence[tuple[str, int]], fingerprints: Sequence[str], step: int) -> int:
        """Take these samples and fingerprints out of the quarantine (a blame withdrawn: they come back from the next
        batch on) and rewrite the file; how many were released. Every rank calls it with the same values."""
        released = 0
        for key, index in samples:
            held = self._record.samples.get(key)
            if held is not None and index in held:
                held.discard(index)
                released += 1
        for fp in fingerprints:
            if fp in self._record.fingerprints:
                self._record.fingerprints.discard(fp)
                released += 1
        if released:
            self._changed(step)
            self._flush()
        return released

    def dataset_size(self) -> int | None:
        """The training samples over every loader whose dataset has a length (``None``: no such loader)."""
        sizes = [len(loader.dataset) for loader in self._loaders if hasattr(loader.dataset, "__len__")]
        return sum(sizes) if sizes else None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return quarantine_file.dump(self._record)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            loaded = quarantine_file.parse(state, strict=False)
        except (ValueError, TypeError, RecursionError) as err:
            raise CheckpointVerificationError(
                f"GradNormMonitor: the checkpoint's quarantine state is malformed ({str(err)[:300]}); resume from "
                "another checkpoint, or with GradNormMonitor(quarantine=False)."
            ) from None
        self._merge(loaded)

    def load_file(self, path: str) -> None:
        """Add what a quarantine file lists (``quarantine_file`` describes the format; validated)."""
        self._merge(quarantine_file.read_file(path))

    def _merge(self, other: QuarantineRecord) -> None:
        for key, indices in other.samples.items():
            self._record.samples.setdefault(key, set()).update(indices)
        self._record.fingerprints.update(other.fingerprints)
        self._record.replaced = max(self._record.replaced, other.replaced)
        self._record.dropped_batches = max(self._record.dropped_batches, other.dropped_batches)
        self._changed(other.step or None)

    def summary_lines(self) -> list[str]:
        if not self.active:
            return []
        pairs = sorted((k, i) for k, ids in self._record.samples.items() for i in ids)
        parts = []
        if pairs:
            shown = _names(pairs[:10]) + (f" and {len(pairs) - 10} more" if len(pairs) > 10 else "")
            parts.append(f"{len(pairs)} sample(s) {shown}")
        if self._record.fingerprints:
            parts.append(f"{len(self._record.fingerprints)} batch fingerprint(s)")
        line = f"quarantined: {', '.join(parts)}; replaced {self.replaced} time(s), {self.dropped_batches} batch "
        line += "update(s) dropped"
        return [line + (f" (list: {self._log_path})" if self._log_path else "")]

    def _changed(self, step: int | None) -> None:
        """What is quarantined changed: the samplers leave out the new sets from their next batch on."""
        self._bad.clear()
        self._refresh_hooks()
        self._touched(step)

    def _refresh_hooks(self) -> None:
        for key, hook in self._hook_items:
            hook.bad = self._bad_of(key)

    def _touched(self, step: int | None) -> None:
        if step is not None:
            self._record.step = int(step)
        self._dirty = True

    def _flush(self, *, force: bool = False) -> None:
        """Write the file (rank 0, a run with a log directory) when something changed since the last write."""
        if self._log_path is None or not (self._dirty or (force and self.active)):
            return
        quarantine_file.write_file(self._log_path, self._record)
        self._dirty = False


def _names(pairs: Sequence[tuple[str, int]]) -> str:
    """``[12, 507]`` for a fit's only loader (or every loader), ``a[3], b[21]`` per loader key otherwise."""
    plain = [i for k, i in pairs if k == EVERY_LOADER]
    keyed = [f"{k}[{i}]" for k, i in pairs if k != EVERY_LOADER]
    return ", ".join(([str(plain)] if plain else []) + keyed)
