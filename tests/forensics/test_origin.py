"""The origin of a step's first non-finite value, traced on real fits: the op, its phase, the line of the test model
that made it, and the pattern ``explain`` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_nanguard.policies.causes import explain
from tests.forensics import origin_models as m

CASES: list[tuple[str, Callable[[], Any], str, str, str, str, str]] = [
    # (id, model, precision, marker, op, phase, kind)
    ("norm_without_eps", m.NormNoEps, "32-true", "norm", "aten.div.Tensor", "forward", "division_by_zero"),
    (
        "where_masked_branch",
        m.MaskedEntropy,
        "32-true",
        "where",
        "aten.log.default",
        "forward",
        "masked_branch_gradient",
    ),
    (
        "fully_masked_row",
        lambda: m.MaskedAttention(fully_masked=True),
        "32-true",
        "softmax",
        "aten._softmax.default",
        "forward",
        "fully_masked_softmax",
    ),
    (
        "bce_on_sigmoid_bf16",
        m.SigmoidBCE,
        "bf16-mixed",
        "bce",
        "aten.log.default",
        "forward",
        "low_precision_rounding",
    ),
    ("exp_overflow_fp16", m.HandSoftmax, "16-true", "exp", "aten.exp.default", "forward", "exp_overflow"),
    ("sqrt_at_zero", m.PairDistance, "32-true", "sqrt", "aten.div.Tensor", "backward", "sqrt_at_zero"),
    (
        "square_overflow_fp16",
        m.SquareFeatures,
        "16-true",
        "square",
        "aten.mul.Tensor",
        "forward",
        "half_precision_overflow",
    ),
    ("nan_record", m.NaNRecord, "32-true", "input", "aten.addmm.default", "input", "input_data"),
]


@pytest.mark.parametrize(
    ("make", "precision", "marker", "op", "phase", "kind"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_origin_names_the_op_and_the_line(
    make: Callable[[], Any], precision: str, marker: str, op: str, phase: str, kind: str
) -> None:
    tracer = m.TraceAt(0, m.BAD_BATCH)
    m.fit(make(), tracer, precision)
    assert tracer.traced[0].origin is None  # a healthy step has no origin
    traced = tracer.traced[m.BAD_BATCH]
    origin = traced.origin
    assert traced.result.reproduced
    assert origin is not None
    assert (origin.op, origin.phase) == (op, phase)
    assert origin.frame is not None
    assert (origin.frame.file, origin.frame.line) == (m.__file__, m.marker_line(marker))
    assert origin.frame.function == ("forward" if marker == "square" else "training_step")
    verdict = explain(origin)
    assert verdict.kind == kind
    assert verdict.data_at_fault is (kind == "input_data")
    if kind != "half_precision_overflow":  # the whole bad batch overflows there
        assert verdict.rows == (m.BAD_ROW,)


def test_an_additive_mask_of_minus_inf_is_no_origin() -> None:
    """A padding mask of -inf in the batch is intended: a healthy step reports nothing, and nothing about the data."""
    tracer = m.TraceAt(0, m.BAD_BATCH)
    m.fit(m.MaskedAttention(), tracer)
    for traced in tracer.traced.values():
        assert not traced.result.reproduced
        assert traced.origin is None


def test_a_fully_masked_row_blames_the_softmax_not_the_mask() -> None:
    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.MaskedAttention(fully_masked=True), tracer)
    origin = tracer.traced[m.BAD_BATCH].origin
    assert origin is not None
    assert origin.stat("rows_all_neg_inf") == 1
    assert "['mask']" in origin.note  # where its -inf came from
    assert not explain(origin).data_at_fault


def test_statistics_explain_each_pattern() -> None:
    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.NormNoEps(), tracer)
    norm = tracer.traced[m.BAD_BATCH].origin
    assert norm is not None
    assert norm.stat("denominator_zeros") == 1
    assert norm.stat("denominator_producer") == "aten.linalg_vector_norm.default"
    assert "eps" in explain(norm).hint

    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.SigmoidBCE(), tracer, "bf16-mixed")
    bce = tracer.traced[m.BAD_BATCH].origin
    assert bce is not None
    assert bce.stat("operand_ones") == 1
    assert bce.stat("operand_dtype") == "torch.bfloat16"
    assert bce.stat("operand_producer") == "aten.sigmoid.default"
    assert "binary_cross_entropy_with_logits" in explain(bce).hint
    assert "1 - 1e-7 rounds to 1.0" in explain(bce).hint

    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.MaskedEntropy(), tracer)
    where = tracer.traced[m.BAD_BATCH].origin
    assert where is not None
    assert where.masked_by == "aten.where.self"
    assert (where.surfaced_phase, where.surfaced_node) == ("backward", "MulBackward0")

    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.HandSoftmax(), tracer, "16-true")
    exp = tracer.traced[m.BAD_BATCH].origin
    assert exp is not None
    assert float(exp.stat("max_arg") or 0) > float(exp.stat("log_max") or 0) == pytest.approx(11.09, abs=0.01)


def test_a_nan_record_names_the_field_and_the_row() -> None:
    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.NaNRecord(), tracer)
    origin = tracer.traced[m.BAD_BATCH].origin
    assert origin is not None
    assert origin.fields == ("[0]",)
    assert origin.rows == (m.BAD_ROW,)
    assert origin.module == "body.0"


def test_a_forward_origin_names_its_module() -> None:
    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.SquareFeatures(), tracer, "16-true")
    origin = tracer.traced[m.BAD_BATCH].origin
    assert origin is not None
    assert origin.module == "square"
    assert origin.input_dtypes == ("torch.float16", "torch.float16")


def test_the_backward_origin_names_its_node() -> None:
    tracer = m.TraceAt(m.BAD_BATCH)
    m.fit(m.PairDistance(), tracer)
    origin = tracer.traced[m.BAD_BATCH].origin
    assert origin is not None
    assert origin.node == "SqrtBackward0"
    assert origin.stat("denominator_zeros") == 1
