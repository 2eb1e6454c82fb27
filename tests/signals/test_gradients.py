from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_nanguard.signals.gradients import GradNorms, ParamIndex, grad_norms, layer_norms, layer_of


def _index(grads: list[torch.Tensor | None], names: list[str] | None = None, depth: int = 1) -> ParamIndex:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros(3 if g is None else g.numel(), dtype=torch.float32 if g is None else g.dtype))
        p.grad = g
        params.append(p)
    return ParamIndex(params, names or [f"m{i}.w" for i in range(len(params))], depth=depth)


def _nonfinite(norms: GradNorms) -> int:
    return int((~torch.isfinite(norms.tensor_norms)).sum())


def test_total_norm_matches_torch_reference() -> None:
    grads = [torch.randn(5), torch.randn(7), torch.randn(2)]
    reading = grad_norms(_index(list(grads)))
    assert reading is not None
    expected = torch.nn.utils.get_total_norm(grads)
    assert torch.allclose(reading.total, expected)
    assert _nonfinite(reading) == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_count_counts_tensors(bad: float) -> None:
    g = torch.randn(4)
    g[1] = bad
    reading = grad_norms(_index([torch.randn(3), g, torch.randn(2)]))
    assert reading is not None
    assert _nonfinite(reading) == 1
    assert not bool(torch.isfinite(reading.total))


def test_large_finite_fp16_grad_is_not_flagged() -> None:
    # norm = 300 * sqrt(1000) = 9486.8 fits fp16, but 3000 * sqrt(1000) = 94868 overflows fp16's 65504
    g = torch.full((1000,), 3000.0, dtype=torch.float16)
    reading = grad_norms(_index([g]))
    assert reading is not None
    assert _nonfinite(reading) == 0
    assert math.isclose(float(reading.total), 3000 * math.sqrt(1000), rel_tol=1e-3)


def test_missing_grads_are_ignored_and_all_missing_gives_none() -> None:
    reading = grad_norms(_index([None, torch.ones(4)]))
    assert reading is not None
    assert reading.present == (1,)
    assert grad_norms(_index([None, None])) is None


def test_scale_divides_norms() -> None:
    reading = grad_norms(_index([torch.full((4,), 8.0)]), scale=torch.tensor(4.0))
    assert reading is not None
    assert math.isclose(float(reading.total), 4.0)


def test_layer_norms_group_by_depth() -> None:
    names = ["enc.a.w", "enc.a.b", "enc.b.w", "head.w", "bias"]
    grads = [torch.full((1,), 3.0), torch.full((1,), 4.0), torch.full((1,), 12.0), torch.full((1,), 1.0), torch.ones(1)]
    index = _index(list(grads), names, depth=1)
    reading = grad_norms(index)
    assert reading is not None
    got = dict(zip(*layer_norms(index, reading), strict=True))
    assert got.keys() == {"enc", "head", "<root>"}
    assert math.isclose(float(got["enc"]), 13.0)
    index2 = _index(list(grads), names, depth=2)
    norms2 = grad_norms(index2)
    assert norms2 is not None
    got2 = dict(zip(*layer_norms(index2, norms2), strict=True))
    assert math.isclose(float(got2["enc.a"]), 5.0)
    assert math.isclose(float(got2["enc.b"]), 12.0)


@pytest.mark.parametrize(
    ("name", "depth", "expected"),
    [
        ("a.b.c.weight", 1, "a"),
        ("a.b.c.weight", 2, "a.b"),
        ("a.b.c.weight", 9, "a.b.c"),
        ("w", 1, "<root>"),
        ("", 1, "<unnamed>"),
    ],
)
def test_layer_of(name: str, depth: int, expected: str) -> None:
    assert layer_of(name, depth) == expected
