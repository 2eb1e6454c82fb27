"""default_callbacks(): the suite in one line, its YAML twin, ablation by name, and remedies that cooperate."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nanguard as ng
from lightning_nanguard.engine import get_engine
from lightning_nanguard.preset import PRESET
from tests.helpers import TinyModel, all_finite, make_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(cb: Callback) -> dict[str, Any]:
    return {k: v for k, v in vars(cb).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}


def test_the_yaml_builds_the_same_suite_as_the_function() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--trainer.callbacks", type=list[Callback], default=[])
    cfg = parser.parse_path(os.path.join(ROOT, "examples", "cli", "preset.yaml"))
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    built = instantiate(cfg).trainer.callbacks
    preset = ng.default_callbacks()
    assert [type(c) for c in built] == [type(c) for c in preset] == list(PRESET)
    assert [_args(c) for c in built] == [_args(c) for c in preset]


def test_overrides_and_ablation_by_name() -> None:
    cbs = ng.default_callbacks(AutoRollback={"every_n_steps": 7}, FP32Evaluation=False)
    assert [type(c).__name__ for c in cbs] == [
        "GradNormMonitor",
        "AutoRollback",
        "OptimizerBackoff",
        "LossScaleWatchdog",
        "CheckpointGuard",
        "PrecisionHeadroom",
    ]
    assert cbs[1].every_n_steps == 7  # type: ignore[attr-defined]
    with pytest.raises(ng.NanGuardConfigError, match=r"default_callbacks\(Rollback=...\): unknown callback"):
        ng.default_callbacks(Rollback=False)
    with pytest.raises(ng.NanGuardConfigError, match=r"default_callbacks\(AutoRollback=3\): must be False"):
        ng.default_callbacks(AutoRollback=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", PRESET, ids=lambda c: c.__name__)
def test_an_unknown_argument_in_an_override_is_a_config_error_naming_it(cls: type[Callback]) -> None:
    """Not a bare ``TypeError`` from the constructor: the callback, the argument and the rule, as for a bad value."""
    with pytest.raises(ng.NanGuardConfigError) as caught:
        ng.default_callbacks(**{cls.__name__: {"nope": 1}})
    message = str(caught.value)
    assert message.startswith(
        f"default_callbacks({cls.__name__}={{'nope': 1}}): {cls.__name__} takes no argument 'nope'"
    )
    assert "must be among its arguments" in message


def test_a_huge_nested_value_is_shortened_in_the_error() -> None:
    """A 7 kB nested value (a config pasted whole) is named in one short line, not printed whole."""
    huge = {"hparams": {f"layer_{i}": {"sizes": list(range(40)), "name": "x" * 100} for i in range(30)}}
    assert len(repr(huge)) > 7000
    for build in (
        lambda: ng.default_callbacks(AutoRollback={"every_n_steps": huge}),
        lambda: ng.default_callbacks(AutoRollback={"unknown": 1, **{str(i): huge for i in range(3)}}),
        lambda: ng.AutoRollback(every_n_steps=huge),  # type: ignore[arg-type]
        lambda: ng.GradNormMonitor(on_nonfinite=huge),  # type: ignore[arg-type]
    ):
        with pytest.raises(ng.NanGuardConfigError) as caught:
            build()
        assert len(str(caught.value)) < 800, str(caught.value)[:300]


class OverflowingLayer(nn.Module):
    """Scales its input up before a projection: beyond float16's range for large inputs, finite in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h * 300.0) / 1000.0)


class Hot(TinyModel):
    """Every 8th input row is 1000x larger: the 'energy' module overflows float16 under autocast on those batches."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.energy = OverflowingLayer()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.energy(self.body(x)))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        x[::8] *= 1000.0
        return DataLoader(TensorDataset(x, x[:, :1] * 0.0), batch_size=8)


def test_a_module_that_keeps_overflowing_in_fp16_is_moved_to_float32(tmp_path: Any) -> None:
    fp32 = ng.FP32Evaluation(promote_after=2)
    trainer = make_trainer(tmp_path, "16-mixed", max_steps=16, callbacks=[ng.GradNormMonitor(), fp32])
    model = Hot()
    trainer.fit(model)
    records = get_engine(trainer).sink.records
    overflows = [r for r in records if r.cause == "half_precision_overflow"]
    promoted = [r for r in records if "promote" in r.actions]
    assert len(promoted) == 1, [(r.step, r.actions, r.cause, r.where) for r in records]
    assert promoted[0].where.startswith("energy")
    assert fp32.promoted == [promoted[0].diagnosis["module"]]
    assert overflows[1] is promoted[0]  # the second overflow in that module promotes it
    # From then on the module runs in float32: no more overflows anywhere.
    assert not [r for r in records if r.step > promoted[0].step]
    assert all_finite(model)
    assert fp32.state_dict()["promoted"] == fp32.promoted
