"""What an origin means: one pattern per cause, each a pure function ``Origin -> OriginVerdict | None``.

A cause decided from the origin of the first non-finite value declares its pattern here and names it in its
``CauseSpec`` (``policies.causes``: ``pattern``, with an ``example`` origin it recognises); the evidence rules of
``policies.rules.origin`` and ``policies.causes.explain`` (the pattern an origin shows, for a bundle and ``nanguard
replay``) both read them from there, in ``EVIDENCE`` order, so an origin means one thing everywhere. A pattern says
what happened (its summary), the hint that works in the precision the op ran in, and the rows it names.
"""

from __future__ import annotations

from lightning_nanguard.policies.origin import HALF, Origin, OriginVerdict

__all__ = [
    "division_by_zero",
    "exp_overflow",
    "fully_masked_softmax",
    "half_precision_overflow",
    "log_of_zero",
    "low_precision_rounding",
    "masked_branch_gradient",
    "nonfinite_input",
    "overflow_past_float32",
    "overflowed",
    "sqrt_at_zero",
]

_DIVISIONS = ("aten.div.", "aten.div_.", "aten.reciprocal", "aten.true_divide", "aten.floor_divide")
_LOGS = ("aten.log.", "aten.log_.", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy", "aten.special_xlogy")
_SQRTS = ("aten.sqrt", "aten.rsqrt")
_SOFTMAXES = ("aten._softmax", "aten._log_softmax", "aten.softmax", "aten.log_softmax", "aten._safe_softmax")
_EXPS = ("aten.exp.", "aten.exp_.", "aten.exp2", "aten.expm1")
_MASKS = ("aten.where", "aten.masked_fill", "aten._s_where")


def _rows(o: Origin) -> str:
    return f" (batch rows {list(o.rows)})" if o.rows else ""


def _at(o: Origin) -> str:
    return f" at {o.frame}" if o.frame else ""


def _dtype(o: Origin) -> str:
    return (o.output_dtype or (o.input_dtypes[0] if o.input_dtypes else "")).replace("torch.", "")


def _half(o: Origin) -> bool:
    return bool({o.output_dtype, *o.input_dtypes} & set(HALF))


def _verdict(kind: str, o: Origin, summary: str, hint: str, data: bool = False) -> OriginVerdict:
    return OriginVerdict(kind, data, summary, hint, o.rows)


def nonfinite_input(o: Origin) -> OriginVerdict | None:
    """NaN/inf already in the step's batch (a field of -inf only is a mask, never an origin)."""
    if o.phase != "input":
        return None
    what = "NaN" if o.produced == "nan" else "inf"
    where = ", ".join(o.fields) or "the batch"
    return _verdict(
        "input_data",
        o,
        f"{what} already in the step's batch: field {where}{_rows(o)}, first used by {o.op}{_at(o)}",
        "check the data pipeline for these records (quarantine skips them)",
        data=True,
    )


def _computed(o: Origin) -> bool:
    return o.phase in ("forward", "backward")


def masked_branch_gradient(o: Origin) -> OriginVerdict | None:
    """A torch.where whose masked branch is non-finite: the forward is finite, its gradient is NaN."""
    if not (o.phase == "forward" and o.masked_by.startswith(_MASKS) and o.surfaced_phase == "backward"):
        return None
    return _verdict(
        "masked_branch_gradient",
        o,
        f"{o.op} made {o.produced} in a branch that {o.masked_by} masks away{_rows(o)}{_at(o)}; its gradient is "
        f"NaN ({o.surfaced_op} in the backward)",
        "torch.where evaluates both branches and backpropagates through the masked one (0 * inf = NaN): make the "
        "masked branch finite before the where, e.g. torch.where(mask, 0, p * torch.log(p.clamp_min(tiny))) or "
        "torch.special.xlogy(p, p) for p * log(p)",
    )


def fully_masked_softmax(o: Origin) -> OriginVerdict | None:
    """A softmax row whose every position is masked with -inf (0 / 0)."""
    full = int(o.stat("rows_all_neg_inf", 0) or 0)
    if not (_computed(o) and (o.op.startswith(_SOFTMAXES) or "scaled_dot_product" in o.op) and full):
        return None
    return _verdict(
        "fully_masked_softmax",
        o,
        f"{o.op}: {full} row(s) of its input are all -inf (every position masked){_rows(o)}{_at(o)}",
        "a fully masked row has no softmax: give every row at least one unmasked position, mask with a large finite "
        "negative (torch.finfo(dtype).min) instead of -inf, or zero those rows' output after the softmax",
    )


def low_precision_rounding(o: Origin) -> OriginVerdict | None:
    """A value rounded to 1.0 (or 0) in a half dtype, then a log of 0: a loss unsafe in low precision."""
    if not (_computed(o) and o.op.startswith(_LOGS)):
        return None
    ones = int(o.stat("operand_ones", 0) or 0)
    under = int(o.stat("underflow_zeros", 0) or 0)
    producer = str(o.stat("operand_producer", "") or "")
    if ones and str(o.stat("operand_dtype", "")) in HALF:
        dtype = str(o.stat("operand_dtype")).replace("torch.", "")
        logits = (
            "compute the loss from the logits: F.binary_cross_entropy_with_logits (or F.logsigmoid(z) and "
            "F.logsigmoid(-z)) is exact in any precision"
            if "sigmoid" in producer
            else "compute log(1 - p) from the logits (log1p(-p) does not help once p is 1.0)"
        )
        return _verdict(
            "low_precision_rounding",
            o,
            f"{ones} value(s) of p rounded to 1.0 in {dtype}, then {o.op} of 1 - p = 0{_rows(o)}{_at(o)}",
            f"{logits}; clamping p to 1 - 1e-7 does not help in {dtype}: 1 - 1e-7 rounds to 1.0",
        )
    if under:
        return _verdict(
            "low_precision_rounding",
            o,
            f"{under} value(s) rounded to 0 in {_dtype(o)} (from {producer}), then {o.op} = -inf{_rows(o)}{_at(o)}",
            "take the log from the logits (F.logsigmoid, F.log_softmax) instead of log of a probability",
        )
    return None


def log_of_zero(o: Origin) -> OriginVerdict | None:
    """A log of 0 (or of a negative value) from finite inputs."""
    if not (_computed(o) and o.op.startswith(_LOGS)):
        return None
    ones = int(o.stat("operand_ones", 0) or 0)
    producer = str(o.stat("operand_producer", "") or "")
    negatives = int(o.stat("input_negatives", 0) or 0)
    what = "a negative input" if negatives and o.produced == "nan" else "0"
    saturated = ones and "sigmoid" in producer  # 1 - sigmoid(z) with z past ~17: 1.0 even in float32
    return _verdict(
        "log_of_zero",
        o,
        f"{o.op} of {what} (input min {o.stat('input_min')})"
        + (f": {ones} value(s) of p = sigmoid(z) are 1.0, so 1 - p = 0" if saturated else "")
        + f"{_rows(o)}{_at(o)}",
        "compute the loss from the logits: F.binary_cross_entropy_with_logits (or F.logsigmoid(z) and "
        "F.logsigmoid(-z)) is exact where sigmoid saturates"
        if saturated
        else "take the log of a quantity that cannot be 0: clamp_min(tiny) in the input's dtype "
        "(torch.finfo(dtype).tiny), or compute it from logits (F.log_softmax, F.logsigmoid)",
    )


def sqrt_at_zero(o: Origin) -> OriginVerdict | None:
    """The gradient of sqrt (or a power < 1) at 0: the backward's inf."""
    if not _computed(o) or o.op.startswith(_LOGS):
        return None
    if not (o.op.startswith(_SQRTS) or "Sqrt" in o.node or ("Pow" in o.node and o.phase == "backward")):
        return None
    return _verdict(
        "sqrt_at_zero",
        o,
        f"the gradient of sqrt (or a power < 1) at 0 is inf: {o.op} in {o.node or 'the forward'}{_rows(o)}{_at(o)}",
        "add eps inside the root: torch.sqrt(x + eps), or use torch.linalg.vector_norm (its gradient at 0 is 0)",
    )


def division_by_zero(o: Origin) -> OriginVerdict | None:
    """A division (or reciprocal) by 0 from finite inputs: a normalisation or a mean without eps."""
    zeros = o.stat("denominator_zeros")
    if not _computed(o) or sqrt_at_zero(o) is not None:
        return None
    if not (o.op.startswith(_DIVISIONS) or (o.op.startswith("aten.pow") and int(zeros or 0))):
        return None
    producer = str(o.stat("denominator_producer", "") or "")
    return _verdict(
        "division_by_zero",
        o,
        f"{o.op}: {zeros} zero(s) in the denominator"
        + (f" ({producer})" if producer else "")
        + f", {o.produced} out{_rows(o)}{_at(o)}",
        "a norm without eps is 0 on an all-zero record: F.normalize(h, dim=-1, eps=1e-6) or "
        "h / h.norm(dim=-1, keepdim=True).clamp_min(1e-6)"
        if "norm" in producer
        else "add eps to the denominator, or clamp_min it (a value representable in "
        f"{_dtype(o) or 'the dtype'}: 1e-6 in float16)",
    )


def exp_overflow(o: Origin) -> OriginVerdict | None:
    """An exp whose argument is past log(the dtype's max)."""
    if not (_computed(o) and o.op.startswith(_EXPS)):
        return None
    return _verdict(
        "exp_overflow",
        o,
        f"{o.op} of {o.stat('max_arg')} in {_dtype(o)} (overflows past {o.stat('log_max')}){_rows(o)}{_at(o)}",
        "subtract the row max before exp (or use torch.softmax / torch.logsumexp, which do)"
        + (", or run this op in float32" if _half(o) else ""),
    )


def overflowed(o: Origin) -> bool:
    """Arithmetic past the dtype's max: its inputs large enough for a product or a sum (of up to 1e6 terms) to reach
    it, and an infinity out (or inputs past the square root of the max). An ``acos(1.5)`` or a ``std`` of one
    element makes NaN from small finite inputs: no overflow, and no evidence of growth."""
    top, big = o.stat("dtype_max"), o.stat("max_abs_input")
    if not _computed(o) or not isinstance(top, (int, float)) or o.op.startswith((*_EXPS, *_LOGS, *_SQRTS)):
        return False
    if not isinstance(big, (int, float)):
        return True  # no finite input to judge by
    return big * big * 1e6 >= top and (o.produced == "inf" or big * big >= top)


def _overflow(o: Origin, kind: str, hint: str) -> OriginVerdict:
    return _verdict(
        kind,
        o,
        f"{o.op} overflowed {_dtype(o)} (inputs up to {o.stat('max_abs_input')}, max {o.stat('dtype_max')})"
        f"{_rows(o)}{_at(o)}",
        hint,
    )


def half_precision_overflow(o: Origin) -> OriginVerdict | None:
    """Arithmetic past a half dtype's max (an ``mm``, a square)."""
    if not (overflowed(o) and _half(o)) or division_by_zero(o) is not None:
        return None
    hint = "run this module in float32 (FP32Evaluation(promote_after=...) under *-mixed), use bf16, or scale its inputs down"
    return _overflow(o, "half_precision_overflow", hint)


def overflow_past_float32(o: Origin) -> OriginVerdict | None:
    """Arithmetic past float32's max: values that large are growth."""
    if not overflowed(o) or _half(o) or division_by_zero(o) is not None:
        return None
    hint = "the values grow past float32's range: lower the learning rate, clip, normalise the inputs"
    return _overflow(o, "gradient_explosion", hint)
