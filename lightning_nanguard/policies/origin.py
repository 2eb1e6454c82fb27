"""The origin of a step's first non-finite value, as plain data.

``Origin`` is what ``forensics.origin`` traced: the first operation (forward or backward) that made a non-finite
value from finite inputs and led to the step's non-finite loss or gradients, with the user's line that called it
and the input statistics that explain it. What it means (``OriginVerdict``: the pattern, whether the data is at
fault, a hint that works in the precision the op ran in) is the cause registry's to say, once, next to each cause
(``policies.causes.explain``; the patterns: ``policies.rules.origin_patterns``). docs/FORENSICS.md has the table.

The statistics an ``Origin`` may carry (``Origin.stats``, every one optional):

==========================  ==========================================================================================
key                         meaning
==========================  ==========================================================================================
``denominator_zeros``       elements of a division's denominator (or a reciprocal's input) that are 0
``numerator_zeros``         ... of which the numerator is 0 too (0/0 = NaN)
``denominator_producer``    the op that made the denominator (``aten.linalg_vector_norm.default``: a norm without eps)
``input_min``               the smallest input value (a log, sqrt or division)
``input_zeros``             input elements that are exactly 0
``input_negatives``         input elements below 0
``rows_all_neg_inf``        rows of a softmax input whose every entry is -inf (fully masked)
``max_arg``                 the largest argument of an ``exp``
``log_max``                 log(the dtype's max): ``exp`` overflows past it (88.7 float32, 11.1 float16)
``max_abs_input``           the largest finite |input| of an overflowing op
``dtype_max``               the largest finite value of the op's output dtype
``operand_ones``            elements equal to 1.0 in the ``p`` of a ``1 - p`` that fed the op
``operand_dtype``           ... the dtype ``p`` was held in
``operand_producer``        ... the op that made ``p`` (``aten.sigmoid.default``)
``underflow_zeros``         zeros of a log's input made by a half-precision ``sigmoid``/``exp``/``softmax`` (rounded to 0)
``nonfinite_elements``      non-finite elements of a step input (``phase="input"``)
==========================  ==========================================================================================
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["HALF", "Origin", "OriginVerdict", "SourceFrame"]

Stat = float | int | str | bool


@dataclass(frozen=True)
class SourceFrame:
    """One line of the user's code."""

    file: str
    line: int
    function: str
    code: str = ""

    def __str__(self) -> str:
        code = f": {self.code}" if self.code else ""
        return f"{self.file}:{self.line} in {self.function}{code}"


@dataclass(frozen=True)
class Origin:
    """The op that made the step's first non-finite value from finite inputs (plain values: picklable, JSON-ready).

    ``phase`` is ``"forward"``, ``"backward"``, ``"input"`` (the value was non-finite in the batch already: ``fields``
    names where, ``rows`` which rows) or ``"state"`` (a parameter or buffer, ``fields`` names it). ``masked_by`` is
    the forward op that discarded the origin's non-finite values (a ``torch.where``), ``surfaced_*`` where they
    reached the step's result when that is another op (a backward op of a masked branch).
    """

    op: str  # the aten overload, "aten.div.Tensor"
    phase: str
    produced: str = "nan"  # "nan" | "inf"
    input_dtypes: tuple[str, ...] = ()
    output_dtype: str = ""
    frame: SourceFrame | None = None
    node: str = ""  # the autograd node a backward op ran in ("SqrtBackward0")
    module: str = ""  # the innermost module whose forward ran the op ("" the LightningModule, forward only)
    stats: tuple[tuple[str, Stat], ...] = ()
    rows: tuple[int, ...] = ()  # batch rows that trigger it (when the op's first dim is the batch's)
    batch_size: int = 0  # the batch's rows (0: unknown), to tell a few triggering records from the whole batch
    fields: tuple[str, ...] = ()  # batch fields ("['mask']", "[0]") or state tensors ("encoder.weight")
    masked_by: str = ""
    masked_frame: SourceFrame | None = None
    surfaced_op: str = ""
    surfaced_phase: str = ""
    surfaced_node: str = ""
    note: str = ""
    ops_checked: int = 0
    truncated: str = ""  # why the trace stopped before the step's end ("" it did not)

    @property
    def trigger_rows(self) -> tuple[int, ...]:
        """The rows that trigger it when they single out some records of the batch, not all of them (a record-level
        trigger); ``()`` when no row, or every row, is named."""
        if not self.rows or (self.batch_size and len(self.rows) >= self.batch_size):
            return ()
        return self.rows

    def stat(self, key: str, default: Stat | None = None) -> Stat | None:
        return next((v for k, v in self.stats if k == key), default)

    @property
    def where(self) -> str:
        """``aten.div.Tensor (forward) at model.py:42 in training_step``."""
        node = f", {self.node}" if self.node else ""
        at = f" at {self.frame.file}:{self.frame.line} in {self.frame.function}" if self.frame else ""
        return f"{self.op} ({self.phase}{node}){at}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stats"] = dict(self.stats)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Origin:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        for key in ("frame", "masked_frame"):
            if isinstance(kw.get(key), dict):
                kw[key] = SourceFrame(**kw[key])
        kw["stats"] = tuple((str(k), v) for k, v in dict(kw.get("stats") or {}).items())
        for key in ("input_dtypes", "rows", "fields"):
            kw[key] = tuple(kw.get(key) or ())
        return cls(**kw)


@dataclass(frozen=True)
class OriginVerdict:
    """What an origin means: the pattern (the cause whose pattern it shows, ``policies.causes.explain``; or
    ``"nonfinite_state"``, ``"unknown"``), whether the data is to blame, and what to do."""

    kind: str
    data_at_fault: bool
    summary: str
    hint: str
    rows: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "data_at_fault": self.data_at_fault,
            "summary": self.summary,
            "hint": self.hint,
            "rows": list(self.rows),
        }


HALF = ("torch.float16", "torch.bfloat16")
