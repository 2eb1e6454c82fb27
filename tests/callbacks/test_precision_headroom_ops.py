"""PrecisionHeadroom sees the op that overflows inside a module's forward, and tries the first float16 step.

Real 16-mixed fits with the CPU GradScaler, the preset installed:

* a hand-written attention (``exp`` of its logits, not max-subtracted) whose logit temperature grows after each
  step: its output stays a weighted mean of its values, far from float16's limit, while ``exp`` heads for 65504;
* a regressor trained in float32 without the suite, resumed in 16-mixed: its de-normalising output module
  (``z * std + mean`` with 0-dim float32 buffers, which do not promote a float16 operand) overflows at the first
  step.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import PrecisionHeadroom, default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.recovery.promote import is_promoted
from tests.helpers import make_trainer

pytestmark = pytest.mark.timeout(180)


class ExpAttention(nn.Module):
    """Self-attention written out by hand: ``exp(q k^T * temperature)`` normalised by its row sums."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("temperature", torch.tensor(0.25))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.q(h) @ self.k(h).transpose(-1, -2) * self.temperature
        weights = torch.exp(logits)
        return (weights / weights.sum(-1, keepdim=True)) @ self.v(h)


class Attention(pl.LightningModule):
    """The temperature grows 6% per step (a learned logit scale running away): ``exp`` passes float16's range."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = ExpAttention()
        self.out = nn.Linear(16, 1)
        self.nonfinite: list[int] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.out(self.attn(self.embed(x))).mean(1)
        loss = nn.functional.mse_loss(pred.float(), y)
        value = float(loss.detach())
        if not math.isfinite(value):
            self.nonfinite.append(self.global_step)
        self.losses.append(value)
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.attn.temperature *= 1.06

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 6, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :, :1].mean(1)), batch_size=8)


def _fit(tmp_path: Any, model: pl.LightningModule, precision: str, callbacks: list[Any], **kw: Any) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, precision, callbacks=callbacks, **{"max_steps": 80, **kw})
    trainer.fit(model)
    return trainer


def test_an_exp_overflowing_inside_attention_is_promoted_before_it_overflows(tmp_path: Any) -> None:
    torch.manual_seed(0)
    reference = Attention()
    _fit(tmp_path / "fp32", reference, "32-true", [])
    torch.manual_seed(0)
    unguarded = Attention()
    _fit(tmp_path / "plain", unguarded, "16-mixed", [])
    assert not reference.nonfinite
    assert len(unguarded.nonfinite) > 5  # exp overflows, and every later step is NaN

    torch.manual_seed(0)
    guarded = Attention()
    callbacks = default_callbacks()
    trainer = _fit(tmp_path / "guarded", guarded, "16-mixed", callbacks)
    assert guarded.nonfinite == []
    assert is_promoted(guarded.attn)
    (record,) = get_engine(trainer).sink.records  # the promotion, and nothing else happened
    assert (record.trigger, record.where, [str(a) for a in record.actions]) == (
        "headroom_forecast",
        "attn",
        ["promote"],
    )
    assert record.values["op"] == "aten.exp"
    assert record.step < unguarded.nonfinite[0]  # before the first overflow
    headroom = next(c for c in callbacks if isinstance(c, PrecisionHeadroom))
    output_bits = headroom.watch.book.bits("attn", 65504.0)
    assert min(b for _, b in output_bits) > 8  # the module's output never came close: only the op did
    final, expected = sum(guarded.losses[-16:]) / 16, sum(reference.losses[-16:]) / 16
    assert final <= 1.05 * expected


class Denormalize(nn.Module):
    """The targets' scale put back: ``z * std + mean`` with the training set's statistics (0-dim buffers)."""

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean))
        self.register_buffer("std", torch.tensor(std))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.std + self.mean


class Regressor(pl.LightningModule):
    """Targets around 4e5: fine in float32, past float16's 65504 once de-normalised."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.denorm = Denormalize(mean=4e5, std=1e5)
        self.nonfinite = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.denorm(self.body(x)).float()
        loss = nn.functional.mse_loss(pred / 1e5, y / 1e5)
        self.nonfinite += not math.isfinite(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=g)
        return DataLoader(TensorDataset(x, 4e5 + 1e5 * x[:, :1]), batch_size=16)


def test_a_float32_model_resumed_in_float16_is_promoted_before_its_first_step(tmp_path: Any) -> None:
    torch.manual_seed(0)
    trained = Regressor()
    trainer = make_trainer(tmp_path / "fp32", "32-true", max_steps=8)  # trained without the suite
    trainer.fit(trained)
    assert trained.nonfinite == 0
    ckpt = str(tmp_path / "fp32.ckpt")
    trainer.save_checkpoint(ckpt)

    def resume(callbacks: list[Any]) -> tuple[Regressor, pl.Trainer]:
        torch.manual_seed(0)
        model = Regressor()
        trainer = make_trainer(tmp_path / "fp16", "16-mixed", callbacks=callbacks, max_steps=24)
        trainer.fit(model, ckpt_path=ckpt)
        return model, trainer

    plain, _ = resume([])
    assert plain.nonfinite > 0  # the first float16 step overflows
    callbacks = default_callbacks()
    guarded, trainer = resume(callbacks)
    assert guarded.nonfinite == 0
    (record,) = get_engine(trainer).sink.records
    assert (record.step, record.where, record.values["op"]) == (8, "denorm", "aten.add")  # + mean: 4e5
    assert record.values["bits"] < 0  # past the limit: it would have overflowed at that very step
