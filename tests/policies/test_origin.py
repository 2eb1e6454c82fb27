"""``policies.origin``: the plain ``Origin`` record and ``explain``, without a Trainer."""

from __future__ import annotations

import json
import pickle

import pytest

from lightning_nanguard.policies.causes import explain
from lightning_nanguard.policies.origin import Origin, SourceFrame

FRAME = SourceFrame("model.py", 42, "training_step", "h = h / h.norm(dim=-1, keepdim=True)")


@pytest.mark.parametrize(
    ("origin", "kind", "data_at_fault", "in_hint"),
    [
        (
            Origin(
                "aten.div.Tensor",
                "forward",
                stats=(("denominator_zeros", 1), ("denominator_producer", "aten.linalg_vector_norm.default")),
            ),
            "division_by_zero",
            False,
            "F.normalize",
        ),
        (
            Origin("aten.log.default", "forward", produced="inf", stats=(("input_min", 0.0),)),
            "log_of_zero",
            False,
            "clamp_min",
        ),
        (
            Origin(
                "aten.log.default",
                "forward",
                produced="inf",
                input_dtypes=("torch.bfloat16",),
                stats=(
                    ("operand_ones", 1),
                    ("operand_dtype", "torch.bfloat16"),
                    ("operand_producer", "aten.sigmoid.default"),
                ),
            ),
            "low_precision_rounding",
            False,
            "binary_cross_entropy_with_logits",
        ),
        (
            Origin("aten.log.default", "forward", stats=(("operand_ones", 1), ("operand_dtype", "torch.float32"))),
            "log_of_zero",  # p == 1.0 in float32 is no rounding of half precision
            False,
            "clamp_min",
        ),
        (
            Origin(
                "aten.log.default",
                "forward",
                masked_by="aten.where.self",
                surfaced_op="aten.mul.Tensor",
                surfaced_phase="backward",
            ),
            "masked_branch_gradient",
            False,
            "xlogy",
        ),
        (
            Origin("aten.exp.default", "forward", masked_by="aten.nll_loss_forward.default", surfaced_phase="backward"),
            "exp_overflow",  # a loss that picks finite entries is no torch.where branch
            False,
            "logsumexp",
        ),
        (
            Origin("aten._softmax.default", "forward", stats=(("rows_all_neg_inf", 2),)),
            "fully_masked_softmax",
            False,
            "unmasked",
        ),
        (Origin("aten.div.Tensor", "backward", node="SqrtBackward0"), "sqrt_at_zero", False, "eps"),
        (
            Origin(
                "aten.exp.default",
                "forward",
                output_dtype="torch.float16",
                stats=(("max_arg", 12.0), ("log_max", 11.09)),
            ),
            "exp_overflow",
            False,
            "float32",
        ),
        (
            Origin("aten.mm.default", "forward", output_dtype="torch.float16", stats=(("dtype_max", 65504.0),)),
            "half_precision_overflow",
            False,
            "float32",
        ),
        (
            Origin("aten.addmm.default", "input", fields=("['x']",), rows=(3,)),
            "input_data",
            True,
            "data pipeline",
        ),
        (
            Origin("aten.addmm.default", "state", fields=("encoder.weight",)),
            "nonfinite_state",
            False,
            "restore",
        ),
        (Origin("aten.foo.default", "forward"), "unknown", False, ""),
    ],
)
def test_explain_names_the_pattern(origin: Origin, kind: str, data_at_fault: bool, in_hint: str) -> None:
    verdict = explain(origin)
    assert verdict.kind == kind
    assert verdict.data_at_fault is data_at_fault
    assert in_hint in verdict.hint


def test_no_origin_is_unknown() -> None:
    assert explain(None).kind == "unknown"


def test_an_origin_is_plain_data() -> None:
    origin = Origin(
        "aten.div.Tensor",
        "forward",
        input_dtypes=("torch.float32", "torch.float32"),
        frame=FRAME,
        stats=(("denominator_zeros", 1), ("denominator_producer", "aten.linalg_vector_norm.default")),
        rows=(2,),
    )
    assert pickle.loads(pickle.dumps(origin)) == origin
    data = json.loads(json.dumps(origin.to_dict()))
    assert data["stats"]["denominator_zeros"] == 1
    assert Origin.from_dict(data) == origin
    assert hash(origin) == hash(Origin.from_dict(data))
    assert origin.stat("denominator_zeros") == 1
    assert origin.where == "aten.div.Tensor (forward) at model.py:42 in training_step"
    assert json.loads(json.dumps(explain(origin).to_dict()))["kind"] == "division_by_zero"
