"""A replay leaves no trace: parameters, gradients, buffers, RNG, modes and autocast are exactly as before."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_nanguard.forensics.replay import run_pass


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 1)
        self.frozen = nn.Linear(2, 2).requires_grad_(False)  # unused and frozen: no gradient asked for

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.head(self.drop(self.norm(self.encoder(x)))).float() - y.float()) ** 2).mean()


def _trainer(plugin: Any) -> Any:
    """The only part of a Trainer a replay pass uses."""
    return SimpleNamespace(precision_plugin=plugin)


def _snapshot(m: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: (p.detach().clone(), p.dtype, p.data_ptr()) for n, p in m.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()},
        "buffers": {n: b.clone() for n, b in m.named_buffers()},
        "modes": [x.training for x in m.modules()],
        "rng": torch.get_rng_state(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "grad_enabled": torch.is_grad_enabled(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for n, (t, dtype, ptr) in a["params"].items():
        t2, dtype2, ptr2 = b["params"][n]
        assert torch.equal(t, t2) and dtype == dtype2 and ptr == ptr2, n  # noqa: PT018
    for n, g in a["grads"].items():
        g2 = b["grads"][n]
        assert (g is None and g2 is None) or torch.equal(g, g2), n
    for n, buf in a["buffers"].items():
        assert torch.equal(buf, b["buffers"][n]), n
    assert a["modes"] == b["modes"]
    assert torch.equal(a["rng"], b["rng"])
    assert (a["autocast"], a["grad_enabled"]) == (b["autocast"], b["grad_enabled"])


@pytest.mark.parametrize(
    ("plugin", "dtype"),
    [
        (Precision(), torch.float32),
        (MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")), torch.float32),
        (HalfPrecision("16-true"), torch.float16),
    ],
)
@pytest.mark.parametrize("float32", [False, True])
def test_replay_leaves_no_trace(plugin: Any, dtype: torch.dtype, float32: bool) -> None:
    model = Net().to(dtype)
    model.train()
    model.frozen.eval()  # a mixed-mode model: each module's mode is restored, not just the root's
    batch = (torch.randn(6, 4, dtype=dtype), torch.randn(6, 1))
    model.training_step(batch, 0).backward()  # type: ignore[no-untyped-call]  # real gradients in .grad
    with torch.no_grad():
        model.norm.running_mean.fill_(0.5)  # type: ignore[union-attr]
    before = _snapshot(model)
    with torch.no_grad():  # the caller's grad mode is restored too
        result = run_pass(_trainer(plugin), model, batch, 0, float32=float32, scale=1024.0)
    assert result.error == ""
    assert not result.reproduced
    assert result.ms > 0
    _same(before, _snapshot(model))


def test_replay_names_the_first_nonfinite_module_and_its_input_range() -> None:
    model = Net()
    with torch.no_grad():
        model.encoder.weight[0, 0] = 1e38
    x = torch.full((4, 4), 10.0)
    result = run_pass(_trainer(Precision()), model, (x, torch.zeros(4, 1)), 0, float32=False)
    assert result.reproduced
    assert (result.first_module, result.first_kind) == ("encoder", "output")
    assert (result.input_min, result.input_max) == (10.0, 10.0)
    assert "encoder.weight" in result.grad_params


def test_replay_names_the_module_whose_backward_goes_nonfinite() -> None:
    class Norm(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt((x * x).sum(-1))  # finite at 0, but d/dx sqrt is inf there: NaN gradient

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.norm = Norm()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.norm(self.lin(batch)).mean()

    model = Model()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()
    result = run_pass(_trainer(Precision()), model, torch.ones(3, 2), 0, float32=False)
    assert result.reproduced
    assert (result.loss_finite, result.outputs_finite, result.grads_finite) == (True, True, False)
    assert (result.first_module, result.first_kind) == ("norm", "gradient")
    assert set(result.grad_params) == {"lin.weight", "lin.bias"}


def test_a_replay_that_raises_is_reported_not_raised() -> None:
    class Broken(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("needs the dataloader's side channel")

    result = run_pass(_trainer(Precision()), Broken(), torch.ones(1, 2), 0, float32=False)
    assert result.error == "RuntimeError: needs the dataloader's side channel"
    assert not result.reproduced
