"""The Trainer-free pieces of FP32Evaluation: patches, float32 weights, deferred logging, the non-finite flag."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard._lightning_compat import AttributePatches
from lightning_nanguard.recovery.eval_precision import (
    DeferredLog,
    Fp32Weights,
    autocast_disabled,
    default_dtype,
    nonfinite_flag,
)


class _Obj:
    def method(self) -> str:
        return "class"


def test_attribute_patches_reassign_previous_and_delete_only_what_they_added() -> None:
    obj = _Obj()
    previous = lambda: "instance"  # noqa: E731 (stands in for a torch.compile wrapper)
    obj.method = previous  # type: ignore[method-assign]
    other = _Obj()
    patches = AttributePatches()
    patches.set(obj, "method", lambda: "patched")
    patches.set(other, "method", lambda: "patched")
    patches.set(obj, "method", lambda: "patched twice")
    assert obj.method() == "patched twice"
    assert patches
    patches.restore()
    assert vars(obj)["method"] is previous
    assert "method" not in vars(other)
    assert other.method() == "class"
    assert not patches


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = nn.Parameter(self.lin.weight.detach().t().contiguous())
        self.register_buffer("shift", torch.full((3,), 0.5))
        self.register_buffer("count", torch.tensor(7))

    def score(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        return self.lin(x) + self.shift, self.lin.weight.dtype


def test_fp32_weights_run_a_method_in_float32_without_touching_the_parameters() -> None:
    net = _Net().to(torch.float16)
    params = dict(net.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    weights = Fp32Weights(net)
    x = torch.randn(2, 4)
    out, seen_dtype = weights.call(net.score, x)
    assert seen_dtype == torch.float32
    assert out.dtype == torch.float32
    expected = x @ net.lin.weight.float().t() + net.lin.bias.float() + net.shift.float()
    torch.testing.assert_close(out, expected)
    assert weights.builds == 1
    weights.call(net.score, x)
    assert weights.builds == 1  # built once, reused
    for n, p in net.named_parameters():
        assert p is params[n]
        assert p.dtype == torch.float16
        assert torch.equal(p, values[n])
    assert net.count.dtype == torch.int64
    weights.release()
    assert not weights.built


def test_deferred_log_replays_or_discards() -> None:
    seen: list[tuple[Any, ...]] = []
    log = DeferredLog(lambda *a, **k: seen.append((a, k)))
    log("direct", 1.0)
    assert seen == [(("direct", 1.0), {})]
    log.begin()
    log("a", torch.tensor(1.0), prog_bar=True)
    log(name="b", value=2.0)
    assert len(seen) == 1
    assert [float(v) for v in log.values()] == [1.0, 2.0]
    log.replay()
    assert [a[0] if a else k["name"] for a, k in seen[1:]] == ["a", "b"]
    log.begin()
    log("c", float("nan"))
    log.discard()
    log("d", 3.0)
    assert [a[0] if a else k["name"] for a, k in seen[1:]] == ["a", "b", "d"]


@pytest.mark.parametrize(
    ("output", "logged", "bad"),
    [
        (torch.tensor(1.0), [], False),
        (torch.tensor(float("inf")), [], True),
        ({"loss": torch.tensor(1.0), "preds": [torch.tensor([1.0, float("nan")])]}, [], True),
        ({"idx": torch.tensor([1, 2])}, [], False),
        (None, [torch.tensor(2.0, dtype=torch.float16)], False),
        (None, [torch.tensor(float("-inf"), dtype=torch.bfloat16)], True),
        (None, [math.nan], True),
        (None, [3, 4.0], False),
        (torch.empty(0), [], False),
    ],
)
def test_nonfinite_flag(output: Any, logged: list[Any], bad: bool) -> None:
    flag = nonfinite_flag(output, logged)
    assert bool(flag) is bad


def test_contexts_restore_what_was_there() -> None:
    with default_dtype(torch.float16):
        assert torch.get_default_dtype() == torch.float16
        with default_dtype(torch.float32):
            assert torch.ones(1).dtype == torch.float32
        assert torch.get_default_dtype() == torch.float16
    assert torch.get_default_dtype() == torch.float32
    lin = nn.Linear(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.ones(1, 2)).dtype == torch.bfloat16
        with autocast_disabled("cpu"):
            assert lin(torch.ones(1, 2)).dtype == torch.float32
