"""``OpProbe``: every half-precision op of a forward, by innermost module, as a fraction of its dtype's limit."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_nanguard.signals.op_headroom import OVERFLOWED, OpProbe


class Inner(nn.Module):
    def __init__(self, scale: float, mask: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale  # float16 under autocast: the product is this module's op
        if self.mask:
            h = h.masked_fill(torch.ones_like(h, dtype=torch.bool).triu(1), -math.inf)
        return torch.exp(h)


class Outer(nn.Module):
    def __init__(self, scale: float, mask: bool = False) -> None:
        super().__init__()
        self.inner = Inner(scale, mask)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x) / 1000)


def _read(model: nn.Module, x: torch.Tensor, overflows: bool = True) -> tuple[dict[str, float], dict[str, str]]:
    probe = OpProbe([(n, m) for n, m in model.named_modules() if n])
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
        probe.arm(overflows=overflows)
        model(x)
        probe.disarm()
    vec = probe.reduce()
    assert vec is not None
    n = len(probe.names)
    values = vec.tolist()
    fractions = {name: values[i] for i, name in enumerate(probe.names)}
    worst = {name: probe.last_ops[int(values[n + i])] for i, name in enumerate(probe.names) if values[n + i] >= 0}
    return fractions, worst


def test_an_exp_is_judged_by_its_input_against_the_log_max_and_attributed_to_the_innermost_module() -> None:
    torch.manual_seed(0)
    model = Outer(scale=1.0)
    with torch.no_grad():
        model.inner.lin.weight.fill_(0.5)
        model.inner.lin.bias.zero_()
    x = torch.ones(2, 4)  # every logit 2.0
    fractions, worst = _read(model, x)
    assert worst["inner"] == "aten.exp"
    assert fractions["inner"] == pytest.approx(2.0 / math.log(65504.0), rel=1e-3)  # e**2 = 7.4 is 2**-13 of 65504
    assert worst["inner.lin"] == "aten.addmm"  # the Linear's own op, not its parent's
    assert fractions["head"] < fractions["inner"]


def test_an_op_that_overflows_is_marked_and_a_minus_inf_mask_is_not() -> None:
    model = Outer(scale=1e5)
    with torch.no_grad():
        model.inner.lin.weight.fill_(0.5)
    fractions, worst = _read(model, torch.ones(2, 4))
    assert fractions["inner"] == OVERFLOWED  # 2e5 in float16: the product overflowed, its inputs were finite
    assert worst["inner"] == "aten.mul"
    fractions, _ = _read(model, torch.ones(2, 4), overflows=False)
    assert fractions["inner"] < 0  # on a sampled step the overflow has happened: the incident path's, not measured

    x = torch.ones(4, 4) * 1e-3
    x[0] = 1.0  # one bad row of four: bad data, not a model that cannot run in float16
    fractions, _ = _read(model, x)
    assert fractions["inner"] < 1

    masked = Outer(scale=1.0, mask=True)
    fractions, _ = _read(masked, torch.ones(2, 4))
    assert 0 < fractions["inner"] < 1  # -inf written by masked_fill is a value; exp of it is 0


def test_nothing_is_measured_outside_half_precision() -> None:
    probe = OpProbe([(n, m) for n, m in Outer(1.0).named_modules() if n])
    probe.arm()
    Outer(1.0)(torch.ones(2, 4))  # float32: no autocast
    probe.disarm()
    assert probe.reduce() is None
