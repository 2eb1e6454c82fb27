"""Evidence from the batch itself (incident path only): non-finite rows, outlier magnitudes, targets out of range.

Nothing here runs on a healthy step. The magnitude test compares the rows of the offending batch with each other
(a row whose largest value is ``ratio`` times the batch's median row), because keeping a running history of input
magnitudes would cost a host read on every healthy step.

**Inputs and targets.** Which parts of a batch are targets is decided by one rule (``split_batch``):

* a mapping (``{"x": ..., "labels": ...}``): its entries under ``TARGET_KEYS`` (``labels``, ``label``, ``targets``,
  ``target``, ``y``, ``classes``, ``class``) are the targets, every other entry is an input;
* a list or tuple of two or more parts (``(x, y)``, ``(x, mask, y)``): its last part is the targets, the others
  are inputs;
* anything else (one tensor, a one-element tuple): inputs only.

**Masks.** An input tensor whose only non-finite values are -inf (finite values and -inf, no NaN, no +inf) is an
additive mask (an attention or padding mask: ``scores + mask``), intended, not bad data: its rows are never
``nonfinite_rows`` (``is_additive_mask``). The origin tracer (``forensics.origin``) takes such a field the same way.
A NaN, or a +inf, in an input is bad data.

A NaN/inf in a target row is ``nonfinite_target_rows`` (a target problem), one in an input row ``nonfinite_rows``;
magnitude outliers are looked for in the inputs only. Class targets are the integer tensors among the targets; they
are checked against the model's output size only where that output can be a class-index head (two or more outputs):
a single output is a binary logit or a regression, whose integer targets (0/1 labels, counts) are not class indices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.signals.batch_rows import floating_tensors, nonfinite_rows
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = [
    "IGNORE_INDEX",
    "MAGNITUDE_RATIO",
    "TARGET_KEYS",
    "BatchFindings",
    "integer_tensors",
    "is_additive_mask",
    "magnitude_outliers",
    "read_batch",
    "split_batch",
    "target_tensor",
]

TARGET_KEYS = ("labels", "label", "targets", "target", "y", "classes", "class")
IGNORE_INDEX = -100  # cross_entropy's default ignore_index (and Hugging Face's padding label): never "out of range"
MAGNITUDE_RATIO = 1e3  # a row whose largest |value| is this many times the batch's median row is an outlier


@dataclass(frozen=True)
class BatchFindings:
    """What one rank's batch shows, as plain values (picklable: gathered across ranks)."""

    nonfinite_rows: tuple[int, ...] = ()  # rows with a NaN/inf in an input
    magnitude_rows: tuple[int, ...] = ()
    max_abs: float = 0.0  # the largest finite |value| in the float inputs
    median_row_abs: float = 0.0  # the median over rows of each row's largest |value|
    target_rows: tuple[int, ...] = ()  # rows whose class target is < 0 or >= output_size (checked with a size only)
    target_min: int | None = None
    target_max: int | None = None
    output_size: int | None = None  # the model's output size the targets were checked against (None: not checked)
    replayable: bool = True
    nonfinite_target_rows: tuple[int, ...] = ()  # rows with a NaN/inf in a target (a float regression target)

    @property
    def rows(self) -> tuple[int, ...]:
        """Every row any of the findings implicates."""
        return tuple(
            sorted({*self.nonfinite_rows, *self.nonfinite_target_rows, *self.magnitude_rows, *self.target_rows})
        )


def split_batch(batch: object) -> tuple[list[Any], list[Any]]:
    """The batch's ``(inputs, targets)`` parts, by the rule in the module docstring."""
    if isinstance(batch, Mapping):
        targets = [v for k, v in batch.items() if k in TARGET_KEYS]
        return [v for k, v in batch.items() if k not in TARGET_KEYS], targets
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return list(batch[:-1]), [batch[-1]]
    return [batch], []


def integer_tensors(batch: object) -> list[Tensor]:
    """Every integer (non-bool) tensor of a (nested) batch, in a stable order."""
    return [
        t for t in iter_tensors(batch) if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool
    ]


def target_tensor(batch: object) -> Tensor | None:
    """The batch's class targets: the first integer entry under ``TARGET_KEYS`` of a mapping, else the last integer
    tensor of a sequence's targets. ``None`` when the batch has none (regression, or integer inputs only)."""
    if isinstance(batch, Mapping):
        for key in TARGET_KEYS:
            value = batch.get(key)
            if isinstance(value, Tensor) and integer_tensors(value):
                return value
        return None
    found = integer_tensors(split_batch(batch)[1])
    return found[-1] if found else None


def magnitude_outliers(batch: object, ratio: float = MAGNITUDE_RATIO) -> tuple[list[int], float, float]:
    """Rows whose largest finite |value| is ``ratio`` times the batch's median row (and the two magnitudes)."""
    row_max: Tensor | None = None
    for t in floating_tensors(batch):
        if t.dim() == 0 or t.numel() == 0:
            continue
        flat = t.detach().reshape(t.shape[0], -1).float().abs()
        flat = torch.where(torch.isfinite(flat), flat, torch.zeros_like(flat))
        m = flat.amax(dim=1).cpu()
        row_max = m if row_max is None or row_max.shape != m.shape else torch.maximum(row_max, m)
    if row_max is None or row_max.numel() == 0:
        return [], 0.0, 0.0
    median = float(row_max.median())
    top = float(row_max.max())
    if row_max.numel() < 2:
        return [], top, median
    limit = max(median, 1e-6) * ratio
    rows = [int(i) for i in torch.nonzero(row_max > limit).reshape(-1).tolist()]
    return rows, top, median


def is_additive_mask(t: Tensor) -> bool:
    """A floating tensor whose only non-finite values are -inf (at least one): an additive mask."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    bad = ~torch.isfinite(t.detach())
    return bool(bad.any()) and bool((t.detach()[bad] == -math.inf).all())


def _unmasked(inputs: list[Any]) -> list[Any]:
    """The inputs without their additive masks (tensors only: the rows of the others are what is checked)."""
    return [t for t in iter_tensors(inputs) if not is_additive_mask(t)]


def read_batch(batch: object, out_size: int | None = None) -> BatchFindings:
    """All the batch evidence of one rank. Targets are checked only against ``out_size``, the model's output size as
    a replay saw it: guessing it from the modules (a tied head has no output Linear) would blame good labels."""
    if batch is None:
        return BatchFindings(replayable=False)
    inputs, targets = split_batch(batch)
    bad = nonfinite_rows(_unmasked(inputs))
    bad_targets = nonfinite_rows(targets)
    mag, top, median = magnitude_outliers(inputs)
    target = target_tensor(batch)
    t_rows: list[int] = []
    t_min = t_max = None
    if target is not None and target.numel() > 0:
        flat = target.detach().reshape(target.shape[0], -1) if target.dim() > 0 else target.reshape(1, 1)
        used = flat != IGNORE_INDEX
        if bool(used.any()):
            t_min, t_max = int(flat[used].min()), int(flat[used].max())
        if out_size is not None and out_size >= 2:  # one output: a binary logit or a regression, not class indices
            wrong = used & ((flat < 0) | (flat >= out_size))
            t_rows = [int(i) for i in torch.nonzero(wrong.any(dim=1)).reshape(-1).tolist()]
    return BatchFindings(
        nonfinite_rows=tuple(bad),
        magnitude_rows=tuple(r for r in mag if r not in bad),
        max_abs=top,
        median_row_abs=median,
        target_rows=tuple(t_rows),
        target_min=t_min,
        target_max=t_max,
        output_size=out_size,
        replayable=True,
        nonfinite_target_rows=tuple(bad_targets),
    )
