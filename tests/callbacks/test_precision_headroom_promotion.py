"""A module PrecisionHeadroom promoted to float32 is an ordinary module: copied, saved, loaded, averaged, compiled.

The promotion comes from a real 16-mixed fit (a layer whose output sits under a bit of float16 headroom); each test
then does what the ecosystem does with a trained model after it.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import PrecisionHeadroom
from lightning_nanguard.recovery.promote import is_promoted
from tests.helpers import make_trainer

pytestmark = pytest.mark.timeout(120)


class NearLimit(pl.LightningModule):
    """``up`` outputs 40000 under float16 autocast: under a bit of headroom, promoted at the first sample."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.up.weight.fill_(10000.0)
            self.up.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(x) / 10000.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self(x).float().squeeze(1) - y) ** 2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(32, 4), torch.zeros(32)), batch_size=8)


@pytest.fixture
def promoted(tmp_path: Any) -> NearLimit:
    torch.manual_seed(0)
    model = NearLimit()
    headroom = PrecisionHeadroom()
    make_trainer(tmp_path, "16-mixed", callbacks=[headroom], max_steps=4).fit(model)
    assert headroom.promoted == ["up"]
    assert is_promoted(model.up)
    return model


def _half_out(model: nn.Module) -> torch.Tensor:
    """The model's output under float16 autocast: ``up`` overflows there unless it runs in float32."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        return model(torch.full((2, 4), 2.0)).float()


def test_a_deepcopy_runs_its_own_weights_in_float32(promoted: NearLimit) -> None:
    clone = copy.deepcopy(promoted)
    assert is_promoted(clone.up)
    assert torch.isfinite(_half_out(clone)).all()  # 80000 in float32: the copy is promoted too
    before = _half_out(promoted)
    with torch.no_grad():
        clone.up.weight.zero_()
    assert torch.equal(_half_out(promoted), before)
    assert not torch.equal(_half_out(clone), before)  # the copy's promoted module reads the copy's weights


def test_torch_save_and_load_keep_the_promotion(promoted: NearLimit) -> None:
    buffer = io.BytesIO()
    torch.save(promoted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert is_promoted(loaded.up)
    assert torch.equal(_half_out(loaded), _half_out(promoted))
    assert torch.isfinite(_half_out(loaded)).all()
    assert "(up): Linear[float32](" in repr(loaded)


def test_the_state_dict_loads_into_a_fresh_unpromoted_model_and_back(promoted: NearLimit) -> None:
    fresh = NearLimit()
    fresh.load_state_dict(promoted.state_dict())  # strict: no key added or missing
    assert not is_promoted(fresh.up)
    assert not torch.isfinite(_half_out(fresh)).all()  # the fresh model runs in float16: the same weights overflow
    promoted.load_state_dict(fresh.state_dict())
    assert is_promoted(promoted.up)


def test_an_averaged_model_averages_its_own_promoted_copy(promoted: NearLimit) -> None:
    averaged = AveragedModel(promoted)
    averaged.update_parameters(promoted)  # the first update copies: 10000
    with torch.no_grad():
        promoted.up.weight.mul_(0.5)
    averaged.update_parameters(promoted)  # the mean of 10000 and 5000
    assert is_promoted(averaged.module.up)
    assert averaged.module.up.weight.mean().item() == pytest.approx(7500.0)
    assert not torch.equal(_half_out(averaged.module), _half_out(promoted))
    assert torch.isfinite(_half_out(averaged.module)).all()


def test_a_promoted_model_compiles(promoted: NearLimit) -> None:
    compiled = torch.compile(promoted, backend="aot_eager")
    assert torch.equal(_half_out(compiled), _half_out(promoted))
    assert torch.isfinite(_half_out(compiled)).all()
