"""The Trainer-free pieces of FP32Evaluation: patches, float32 weights, deferred logging, the non-finite flag."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn

from lightning_nanguard._lightning_compat import AttributePatches, MetricStates
from lightning_nanguard.recovery.eval_precision import (
    DeferredLog,
    Fp32Weights,
    RerunGroup,
    autocast_disabled,
    default_dtype,
    group_reruns,
    nonfinite_flag,
    rerun_message,
    rerun_where,
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


def test_group_reruns_one_group_per_stage_and_outcome() -> None:
    # Rank 0 re-ran batches 2 and 0 (finite in float32); rank 1 re-ran 2 (not finite there) and 5 (finite).
    gathered = [[("validation", 2, True), ("validation", 0, True)], [("validation", 2, False), ("validation", 5, True)]]
    groups = group_reruns(gathered)
    assert groups == [
        RerunGroup("validation", True, (0, 5), (0, 1)),
        RerunGroup("validation", False, (2,), (0, 1)),  # finite only where every rank that re-ran it found it so
    ]
    assert rerun_where(groups[1]) == "validation batch 2"
    assert rerun_message(groups[1], "float16") == (
        "1 validation batch (2) is non-finite in float16 and in float32 too: not a precision overflow. Check this "
        "batch's data and the model's weights."
    )
    many = RerunGroup("test", True, tuple(range(11)), (0,))
    assert rerun_where(many) == "11 test batches: 0, 1, 2, 3, 4, 5, 6, 7 and 3 more"
    assert group_reruns([[], []]) == []


def test_metric_states_put_back_in_place() -> None:
    module = nn.Module()
    module.total = torchmetrics.SumMetric()
    module.seen = torchmetrics.CatMetric()
    module.total.update(torch.tensor(2.0))
    module.seen.update(torch.tensor([1.0]))
    total_state, seen_state = module.total.sum_value, module.seen.value
    states = MetricStates(module)
    assert bool(states)
    assert not MetricStates(nn.Linear(1, 1))
    saved = states.save()
    module.total.update(torch.tensor(5.0))
    module.seen.update(torch.tensor([7.0]))
    MetricStates.restore(saved)
    assert float(module.total.compute()) == 2.0
    assert module.total.update_count == 1
    assert module.seen.compute().flatten().tolist() == [1.0]
    assert module.total.sum_value is total_state
    assert module.seen.value is seen_state
