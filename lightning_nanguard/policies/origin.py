"""The origin of a step's first non-finite value, as plain data, and what it means: ``explain(origin) -> verdict``.

``Origin`` is what ``forensics.origin`` traced: the first operation (forward or backward) that made a non-finite
value from finite inputs and led to the step's non-finite loss or gradients, with the user's line that called it
and the input statistics that explain it. ``explain`` is pure: it names the pattern (``OriginKind``), whether the
data is at fault, and a hint that works in the precision the op ran in. docs/FORENSICS.md has the table.

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
from enum import Enum
from typing import Any

__all__ = ["Origin", "OriginKind", "OriginVerdict", "SourceFrame", "explain"]

Stat = float | int | str | bool


class OriginKind(str, Enum):
    """The pattern an origin shows."""

    DIVISION_BY_ZERO = "division_by_zero"  # x / 0 (a normalisation or a mean without eps)
    LOG_OF_ZERO = "log_of_zero"  # log(0) = -inf, log(<0) = NaN
    SQRT_AT_ZERO = "sqrt_at_zero"  # the gradient of sqrt (or a power < 1) at 0 is inf
    MASKED_BRANCH_GRADIENT = "masked_branch_gradient"  # torch.where masks a non-finite branch: its gradient is NaN
    FULLY_MASKED_SOFTMAX = "fully_masked_softmax"  # a softmax row that is all -inf
    LOW_PRECISION_ROUNDING = "low_precision_rounding"  # a value rounded to 1.0 (or 0) in a half dtype, then log
    EXP_OVERFLOW = "exp_overflow"  # exp of an argument past log(dtype max)
    OVERFLOW = "overflow"  # arithmetic past the dtype's max (a matmul or sum in half precision)
    NONFINITE_INPUT = "nonfinite_input"  # NaN/inf already in the step's batch
    NONFINITE_STATE = "nonfinite_state"  # NaN/inf already in a parameter or buffer
    UNKNOWN = "unknown"


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
    """What an origin means: the pattern, whether the data is to blame, and what to do."""

    kind: OriginKind
    data_at_fault: bool
    summary: str
    hint: str
    rows: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "data_at_fault": self.data_at_fault,
            "summary": self.summary,
            "hint": self.hint,
            "rows": list(self.rows),
        }


HALF = ("torch.float16", "torch.bfloat16")
_DIVISIONS = ("aten.div.", "aten.div_.", "aten.reciprocal", "aten.true_divide", "aten.floor_divide")
_LOGS = ("aten.log.", "aten.log_.", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy", "aten.special_xlogy")
_SQRTS = ("aten.sqrt", "aten.rsqrt")
_SOFTMAXES = ("aten._softmax", "aten._log_softmax", "aten.softmax", "aten.log_softmax", "aten._safe_softmax")
_EXPS = ("aten.exp.", "aten.exp_.", "aten.exp2", "aten.expm1")
_MASKS = ("aten.where", "aten.masked_fill", "aten._s_where")


def _rows(o: Origin) -> str:
    return f" (batch rows {list(o.rows)})" if o.rows else ""


def _dtype(o: Origin) -> str:
    return (o.output_dtype or (o.input_dtypes[0] if o.input_dtypes else "")).replace("torch.", "")


def _half(o: Origin) -> bool:
    return bool({o.output_dtype, *o.input_dtypes} & set(HALF))


def _overflowed(o: Origin) -> bool:
    """Arithmetic past the dtype's max: its inputs large enough for a product or a sum (of up to 1e6 terms) to reach
    it, and an infinity out (or inputs past the square root of the max). An ``acos(1.5)`` or a ``std`` of one
    element makes NaN from small finite inputs: no overflow, and no evidence of growth."""
    top, big = o.stat("dtype_max"), o.stat("max_abs_input")
    if not isinstance(top, (int, float)):
        return False
    if not isinstance(big, (int, float)):
        return True  # no finite input to judge by
    return big * big * 1e6 >= top and (o.produced == "inf" or big * big >= top)


def explain(origin: Origin | None) -> OriginVerdict:
    """The pattern behind ``origin`` (``None``: nothing was traced), whether the data is at fault, and the hint."""
    if origin is None:
        return OriginVerdict(OriginKind.UNKNOWN, False, "no origin traced", "")
    o = origin
    op = o.op
    at = f" at {o.frame}" if o.frame else ""
    if o.phase == "input":
        what = "NaN" if o.produced == "nan" else "inf"
        where = ", ".join(o.fields) or "the batch"
        return OriginVerdict(
            OriginKind.NONFINITE_INPUT,
            True,
            f"{what} already in the step's batch: field {where}{_rows(o)}, first used by {op}{at}",
            "check the data pipeline for these records (quarantine skips them)",
            o.rows,
        )
    if o.phase == "state":
        return OriginVerdict(
            OriginKind.NONFINITE_STATE,
            False,
            f"non-finite values already in {', '.join(o.fields) or 'the model state'}, first used by {op}{at}",
            "restore an earlier state (AutoRollback) and find what wrote these values",
        )
    if o.masked_by.startswith(_MASKS) and o.surfaced_phase == "backward" and o.phase == "forward":
        return OriginVerdict(
            OriginKind.MASKED_BRANCH_GRADIENT,
            False,
            f"{op} made {o.produced} in a branch that {o.masked_by} masks away{_rows(o)}{at}; its gradient is "
            f"NaN ({o.surfaced_op} in the backward)",
            "torch.where evaluates both branches and backpropagates through the masked one (0 * inf = NaN): make the "
            "masked branch finite before the where, e.g. torch.where(mask, 0, p * torch.log(p.clamp_min(tiny))) or "
            "torch.special.xlogy(p, p) for p * log(p)",
            o.rows,
        )
    if op.startswith(_SOFTMAXES) or "scaled_dot_product" in op:
        full = int(o.stat("rows_all_neg_inf", 0) or 0)
        if full:
            return OriginVerdict(
                OriginKind.FULLY_MASKED_SOFTMAX,
                False,
                f"{op}: {full} row(s) of its input are all -inf (every position masked){_rows(o)}{at}",
                "a fully masked row has no softmax: give every row at least one unmasked position, mask with a large "
                "finite negative (torch.finfo(dtype).min) instead of -inf, or zero those rows' output after the "
                "softmax",
                o.rows,
            )
    if op.startswith(_LOGS):
        ones = int(o.stat("operand_ones", 0) or 0)
        under = int(o.stat("underflow_zeros", 0) or 0)
        producer = str(o.stat("operand_producer", "") or "")
        if ones and str(o.stat("operand_dtype", "")) in HALF:
            dtype = str(o.stat("operand_dtype")).replace("torch.", "")
            bce = "sigmoid" in producer
            return OriginVerdict(
                OriginKind.LOW_PRECISION_ROUNDING,
                False,
                f"{ones} value(s) of p rounded to 1.0 in {dtype}, then {op} of 1 - p = 0{_rows(o)}{at}",
                (
                    "compute the loss from the logits: F.binary_cross_entropy_with_logits (or F.logsigmoid(z) and "
                    "F.logsigmoid(-z)) is exact in any precision"
                    if bce
                    else "compute log(1 - p) from the logits (log1p(-p) does not help once p is 1.0)"
                )
                + f"; clamping p to 1 - 1e-7 does not help in {dtype}: 1 - 1e-7 rounds to 1.0",
                o.rows,
            )
        if under:
            return OriginVerdict(
                OriginKind.LOW_PRECISION_ROUNDING,
                False,
                f"{under} value(s) rounded to 0 in {_dtype(o)} (from {producer}), then {op} = -inf{_rows(o)}{at}",
                "take the log from the logits (F.logsigmoid, F.log_softmax) instead of log of a probability",
                o.rows,
            )
        negatives = int(o.stat("input_negatives", 0) or 0)
        what = "a negative input" if negatives and o.produced == "nan" else "0"
        saturated = ones and "sigmoid" in producer  # 1 - sigmoid(z) with z past ~17: 1.0 even in float32
        return OriginVerdict(
            OriginKind.LOG_OF_ZERO,
            False,
            f"{op} of {what} (input min {o.stat('input_min')})"
            + (f": {ones} value(s) of p = sigmoid(z) are 1.0, so 1 - p = 0" if saturated else "")
            + f"{_rows(o)}{at}",
            "compute the loss from the logits: F.binary_cross_entropy_with_logits (or F.logsigmoid(z) and "
            "F.logsigmoid(-z)) is exact where sigmoid saturates"
            if saturated
            else "take the log of a quantity that cannot be 0: clamp_min(tiny) in the input's dtype "
            "(torch.finfo(dtype).tiny), or compute it from logits (F.log_softmax, F.logsigmoid)",
            o.rows,
        )
    if op.startswith(_SQRTS) or "Sqrt" in o.node or ("Pow" in o.node and o.phase == "backward"):
        return OriginVerdict(
            OriginKind.SQRT_AT_ZERO,
            False,
            f"the gradient of sqrt (or a power < 1) at 0 is inf: {op} in {o.node or 'the forward'}{_rows(o)}{at}",
            "add eps inside the root: torch.sqrt(x + eps), or use torch.linalg.vector_norm (its gradient at 0 is 0)",
            o.rows,
        )
    if op.startswith(_DIVISIONS) or (op.startswith("aten.pow") and int(o.stat("denominator_zeros", 0) or 0)):
        zeros = o.stat("denominator_zeros")
        producer = str(o.stat("denominator_producer", "") or "")
        norm = "norm" in producer
        return OriginVerdict(
            OriginKind.DIVISION_BY_ZERO,
            False,
            f"{op}: {zeros} zero(s) in the denominator"
            + (f" ({producer})" if producer else "")
            + f", {o.produced} out{_rows(o)}{at}",
            (
                "a norm without eps is 0 on an all-zero record: F.normalize(h, dim=-1, eps=1e-6) or "
                "h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)"
                if norm
                else "add eps to the denominator, or clamp_min it (a value representable in "
                f"{_dtype(o) or 'the dtype'}: 1e-6 in float16)"
            ),
            o.rows,
        )
    if op.startswith(_EXPS):
        return OriginVerdict(
            OriginKind.EXP_OVERFLOW,
            False,
            f"{op} of {o.stat('max_arg')} in {_dtype(o)} (overflows past {o.stat('log_max')}){_rows(o)}{at}",
            "subtract the row max before exp (or use torch.softmax / torch.logsumexp, which do)"
            + (", or run this op in float32" if _half(o) else ""),
            o.rows,
        )
    if _overflowed(o):
        return OriginVerdict(
            OriginKind.OVERFLOW,
            False,
            f"{op} overflowed {_dtype(o)} (inputs up to {o.stat('max_abs_input')}, max {o.stat('dtype_max')})"
            f"{_rows(o)}{at}",
            (
                "run this module in float32 (FP32Evaluation(promote_after=...) under *-mixed), use bf16, or scale "
                "its inputs down"
                if _half(o)
                else "the values grow past float32's range: lower the learning rate, clip, normalise the inputs"
            ),
            o.rows,
        )
    return OriginVerdict(OriginKind.UNKNOWN, False, f"{op} made {o.produced} from finite inputs{at}", "", o.rows)
