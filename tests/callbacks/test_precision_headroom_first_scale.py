"""The start of a 16-mixed fit drops no update: the first step's trial measures its gradient, and the GradScaler's
scale starts where that gradient's float16 headroom says (never above the scale it was configured with).

A 1000-class head on large features: at torch's default initial scale (65536) the float16 backward overflows, and
the GradScaler drops the first steps while it walks its scale down.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import PrecisionHeadroom, default_callbacks
from tests.helpers import make_trainer

pytestmark = pytest.mark.timeout(120)


class ThousandClasses(pl.LightningModule):
    """A 1000-class head over 256 ReLU features 300 times larger than a default init's."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU())
        self.head = nn.Linear(256, 1000)
        with torch.no_grad():
            self.body[0].weight.mul_(300.0)
        self.dropped: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.body(x)).float(), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # Unscaled by now: a non-finite gradient is an update the GradScaler drops.
        if not all(bool(torch.isfinite(p.grad).all()) for p in self.parameters() if p.grad is not None):
            self.dropped.append(len(self.dropped) + 1)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(640, 32, generator=g)
        return DataLoader(TensorDataset(x, torch.randint(0, 1000, (640,), generator=g)), batch_size=64)


def _fit(tmp_path: Any, callbacks: list[Any]) -> tuple[ThousandClasses, pl.Trainer]:
    torch.manual_seed(0)
    model = ThousandClasses()
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]  # 65536, torch's default
    trainer = make_trainer(tmp_path, "16-mixed", callbacks=callbacks, max_steps=20, plugins=plugins)
    trainer.fit(model)
    return model, trainer


def test_a_thousand_class_head_drops_no_update_in_its_first_steps(tmp_path: Any) -> None:
    plain, _ = _fit(tmp_path / "plain", [])
    assert len(plain.dropped) >= 4  # the GradScaler walks down from 65536, one dropped update per halving

    callbacks = default_callbacks()
    guarded, trainer = _fit(tmp_path / "guarded", callbacks)
    assert guarded.dropped == []
    lowerings = next(c for c in callbacks if isinstance(c, PrecisionHeadroom)).watch.scaled.lowerings
    assert lowerings.first_from == 65536.0  # lowered from the configured scale before the first backward
    assert float(trainer.precision_plugin.scaler.get_scale()) < 65536.0  # type: ignore[attr-defined]


def test_the_fp16_explosion_demo_has_no_nonfinite_step_with_the_preset(tmp_path: Any) -> None:
    from lightning_nanguard.demo import run_task
    from lightning_nanguard.demo.presets import preset

    unguarded = run_task("fp16-explosion", [], seed=0, root_dir=str(tmp_path), config="unguarded")
    assert not unguarded.finished  # the forward overflows, every later step is dropped
    run = run_task("fp16-explosion", preset(), seed=0, root_dir=str(tmp_path), config="preset")
    assert run.finished, run.error
    assert run.skipped_steps == 0, run.actions()
    assert not [i for i in run.incidents if str(i.trigger).startswith("nonfinite")], run.actions()
