"""Which dataset samples the implicated rows of a batch are (incident path only): per training loader.

The diagnosis names rows of the batch the model saw (``Diagnosis.rows``); the quarantine keeps sample indices per
training loader (``TrainLoader``). Mapping one to the other:

* **several training loaders** (``{"a": loader_a, "b": loader_b}``): each loader's part of the batch is read on its
  own (``signals.batch.read_batch``), and a loader takes the implicated rows that its own part shows as bad: row 5
  of loader "a" is not row 5 of loader "b".
* **the collate function keeps the order** (``default_collate``, ``default_convert``): row ``r`` is the sampler's
  ``r``-th index.
* **any other collate function** may reorder the rows (sorting by length for packed sequences): the batch's samples
  are read again from the dataset (``dataset[i]``, each collated alone) and the ones whose own values are bad
  (non-finite, or ``MAGNITUDE_RATIO`` x the median sample) are taken, whatever their row. Where none shows it (the
  fault is made by the collate function or a random transform), the rows are taken by position, and the result
  says so.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import default_collate, default_convert

from lightning_nanguard.signals.batch import MAGNITUDE_RATIO, read_batch
from lightning_nanguard.signals.tensors import at_path

__all__ = ["TrainLoader", "samples_of_rows"]

_ORDER_KEEPING = (default_collate, default_convert)


@dataclass(frozen=True)
class TrainLoader:
    """One training loader of the fit: its key in the quarantine, its path in the batch, what it loads from."""

    key: str  # "" for a fit's only loader, else the CombinedLoader key path ("a", "0", "a.1")
    path: tuple[Any, ...]  # where its batch sits in the batch Lightning builds (``signals.tensors.at_path``)
    dataset: Any
    collate_fn: Any

    @property
    def keeps_order(self) -> bool:
        return self.collate_fn in _ORDER_KEEPING


def samples_of_rows(
    batch: object,
    rows: Sequence[int],
    loaders: Sequence[TrainLoader],
    current: dict[str, list[int] | None],
) -> tuple[list[tuple[str, int]], str]:
    """The ``(loader key, sample index)`` pairs behind ``rows`` of ``batch`` (every row when ``rows`` is empty), and a
    note when some were mapped by position only. ``current`` holds each loader's indices for this batch."""
    picked: list[tuple[str, int]] = []
    by_position = False
    several = len(loaders) > 1
    for loader in loaders:
        indices = current.get(loader.key)
        part = at_path(batch, loader.path)
        if indices is None or part is None or not all(isinstance(i, numbers.Integral) for i in indices):
            continue
        n = len(indices)
        wanted = [r for r in rows if 0 <= r < n] if rows else list(range(n))
        if several and rows:
            shown = set(read_batch(part).rows)
            wanted = [r for r in wanted if r in shown]
        if not wanted:
            continue
        found = None if loader.keeps_order else _bad_samples(loader.dataset, indices)
        if found:
            picked.extend((loader.key, int(i)) for i in found)
            continue
        by_position = by_position or not loader.keeps_order
        picked.extend((loader.key, int(indices[r])) for r in wanted)
    note = "mapped by position (the collate function may reorder rows and the samples read again looked sound)"
    return picked, note if by_position and picked else ""


def _bad_samples(dataset: Any, indices: Sequence[Any]) -> list[Any] | None:
    """The indices whose sample, read again and collated alone, is non-finite or an outsized outlier; ``None`` where
    the dataset cannot be read back."""
    try:
        findings = [read_batch(default_collate([dataset[i]])) for i in indices]
    except Exception:  # a dataset that cannot be indexed again: the rows are mapped by position
        return None
    bad = [i for i, f in zip(indices, findings, strict=True) if f.nonfinite_rows or f.nonfinite_target_rows]
    tops = sorted(f.max_abs for f in findings)
    if len(tops) >= 2:
        limit = max(tops[(len(tops) - 1) // 2], 1e-6) * MAGNITUDE_RATIO  # the lower median, as torch's
        bad += [i for i, f in zip(indices, findings, strict=True) if f.max_abs > limit and i not in bad]
    return bad
