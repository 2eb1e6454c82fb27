"""PrecisionHeadroom on real fits: a module headed for a float16 overflow runs in float32 before it overflows.

The models are the seeds' shapes, small: a class head with far too many outputs whose unused logits run away, an
attention whose logits grow, a model trained in float32 (massive activations) resumed in float16. The growth is made
by the model itself (a drift applied after each step), so it comes at the same step with or without the callback:
unguarded, float16 overflows into NaN steps; with the forecast, none, and the final loss matches float32's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import FP32Evaluation, PrecisionHeadroom, default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.reporting import keys
from lightning_nanguard.reporting.dashboard import LAYOUT
from lightning_nanguard.testing import HostReadCounter
from tests.helpers import TinyModel, make_trainer, tb_scalars

pytestmark = pytest.mark.timeout(120)


class _Drifting(pl.LightningModule):
    """Counts the non-finite training losses; ``drift`` runs after each optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.nonfinite = 0
        self.losses: list[float] = []
        self.hooked_steps: list[int] = []  # forward (pre-)hooks and dispatch modes seen in training_step, per step
        self.lr = 0.05

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss(x, y)
        value = float(loss.detach())
        self.nonfinite += not math.isfinite(value)
        self.losses.append(value)
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.modules())
        self.hooked_steps.append(hooks + (_get_current_dispatch_mode() is not None))  # the op trace's mode too
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.drift()

    def drift(self) -> None:
        raise NotImplementedError

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def final_loss(self) -> float:
        """The mean loss of the last 16 steps (one batch's loss is noisy)."""
        return sum(self.losses[-16:]) / 16


class ClassHead(_Drifting):
    """1000 classes on 10-class data: the unused classes' logits (weights and biases) grow 15% per step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 1000)
        with torch.no_grad():
            self.head.bias[10:] = -100.0

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        centred = logits - logits.mean(-1, keepdim=True)  # a row with an overflowed logit is NaN here
        return nn.functional.cross_entropy(centred.float(), y)

    def drift(self) -> None:
        self.head.weight[10:] *= 1.15
        self.head.bias[10:] *= 1.15

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 16, generator=g)
        return DataLoader(TensorDataset(x, x[:, :10].argmax(-1)), batch_size=16)


class Scores(nn.Module):
    """Attention logits as a module of their own, with a logit scale (CLIP's ``logit_scale``, which grows)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2) * self.scale


class GrowingAttention(_Drifting):
    """Self-attention whose logit scale grows 20% per step: the logits pass float16's range within 60 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.scores = Scores()
        self.out = nn.Linear(16, 1)
        self.lr = 0.01

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        attn = torch.softmax(self.scores(self.q(h), self.k(h)).float(), dim=-1)
        pred = self.out(attn.to(h.dtype) @ self.v(h)).mean(1)
        return nn.functional.mse_loss(pred.float(), y)

    def drift(self) -> None:
        self.scores.scale *= 1.2

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 6, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :, :1].mean(1)), batch_size=8)


def _fit(tmp_path: Any, model: pl.LightningModule, precision: str, callbacks: list[Any], **kw: Any) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, precision, callbacks=callbacks, **{"max_steps": 80, **kw})
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize(("model_cls", "steps"), [(ClassHead, 80), (GrowingAttention, 80)])
def test_a_module_headed_for_overflow_runs_in_float32_before_it_overflows(
    tmp_path: Any, model_cls: type, steps: int
) -> None:
    torch.manual_seed(0)
    reference = model_cls()
    _fit(tmp_path / "fp32", reference, "32-true", [], max_steps=steps)
    torch.manual_seed(0)
    unguarded = model_cls()
    _fit(tmp_path / "plain", unguarded, "16-mixed", [], max_steps=steps)
    assert reference.nonfinite == 0
    assert unguarded.nonfinite > 5  # today: the overflow comes, every later step is NaN

    torch.manual_seed(0)
    guarded = model_cls()
    callbacks = default_callbacks()
    trainer = _fit(tmp_path / "guarded", guarded, "16-mixed", callbacks, max_steps=steps)
    assert guarded.nonfinite == 0
    assert guarded.final_loss() <= 1.05 * reference.final_loss()
    headroom = next(c for c in callbacks if isinstance(c, PrecisionHeadroom))
    expected = "head" if model_cls is ClassHead else "scores"
    assert headroom.promoted == [expected]
    (record,) = get_engine(trainer).sink.records  # the promotion, and nothing else happened
    assert (record.trigger, record.where, [str(a) for a in record.actions]) == (
        "headroom_forecast",
        expected,
        ["promote"],
    )
    assert record.values["steps_to_overflow"] > 0
    assert len(record.values["history"]) >= 3  # type: ignore[arg-type]


def test_report_only_moves_nothing(tmp_path: Any) -> None:
    model = ClassHead()
    trainer = _fit(tmp_path, model, "16-mixed", [PrecisionHeadroom(promote=False)], max_steps=60)
    assert model.nonfinite > 0
    assert get_engine(trainer).sink.records == []


def test_a_healthy_float16_run_promotes_nothing_and_shows_its_headroom(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    callbacks = default_callbacks()
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    trainer = make_trainer(tmp_path, "16-mixed", logger=logger, callbacks=callbacks, max_steps=30, log_every_n_steps=5)
    trainer.fit(TinyModel())
    headroom = next(c for c in callbacks if isinstance(c, PrecisionHeadroom))
    assert headroom.promoted == []
    assert get_engine(trainer).sink.records == []
    scalars = tb_scalars(logger.log_dir)
    lowest = scalars[keys.HEADROOM_MIN]
    assert lowest
    assert all(10 < bits < 30 for _, bits in lowest)
    modules = {tag for tag in scalars if tag.startswith(keys.HEADROOM + "/")}
    assert modules == {keys.key("headroom", m) for m in ("body.0", "body.1", "head")}
    assert scalars[keys.PROMOTED_MODULES][-1][1] == 0.0
    assert any(keys.HEADROOM_MIN in str(chart) for chart in LAYOUT["nanguard: precision"].values())
    with open(os.path.join(logger.log_dir, "nanguard", "summary.txt"), encoding="utf-8") as f:
        assert "closest to overflow: " in f.read()


def test_unsampled_steps_have_no_hooks_and_no_host_reads(tmp_path: Any) -> None:
    def run(callbacks: list[Any]) -> tuple[ClassHead, int]:
        torch.manual_seed(0)
        model = ClassHead()
        model.drift = lambda: None  # type: ignore[method-assign]  # healthy
        with HostReadCounter() as reads:  # the whole fit: every hook of every step
            _fit(tmp_path, model, "16-mixed", callbacks, max_steps=24)
        return model, reads.count

    # FP32Evaluation reads nothing per training step; it brings the end-of-fit state check both runs then make.
    plain, plain_reads = run([FP32Evaluation()])
    guarded, guarded_reads = run([FP32Evaluation(), PrecisionHeadroom(every_n_steps=8)])
    sampled = [i for i, hooks in enumerate(guarded.hooked_steps) if hooks]
    assert sampled[0] == 0
    assert 1 < len(sampled) < len(guarded.hooked_steps) // 2
    assert all(h == 0 for h in plain.hooked_steps)
    # Not one more host read, sampled steps included, but the model's own: the first step's trial runs its
    # training_step once, whose ``float(loss)`` reads (the trial's result is copied into a host buffer).
    assert guarded_reads == plain_reads + 1


class Residual(_Drifting):
    """A pre-LayerNorm residual MLP with massive activations: its ``fc2`` writes values of ~1e5 into the
    residual stream (fine in float32, past float16's 65504), which the next LayerNorm brings back."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.out = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 1))
        with torch.no_grad():
            self.fc2.weight *= 2e5

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x + self.fc2(torch.relu(self.fc1(self.norm(x))))
        return nn.functional.mse_loss(self.out(h).float(), y)

    def drift(self) -> None:
        pass

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


def test_a_float32_run_resumed_in_float16_is_promoted_before_its_first_step(tmp_path: Any) -> None:
    torch.manual_seed(0)
    trained = Residual()
    trainer = _fit(tmp_path / "fp32", trained, "32-true", [PrecisionHeadroom()], max_steps=8)
    assert trained.nonfinite == 0
    ckpt = str(tmp_path / "fp32.ckpt")
    trainer.save_checkpoint(ckpt)

    def resume(callbacks: list[Any]) -> tuple[Residual, pl.Trainer]:
        torch.manual_seed(0)
        model = Residual()
        trainer = make_trainer(tmp_path / "fp16", "16-mixed", callbacks=callbacks, max_steps=16)
        trainer.fit(model, ckpt_path=ckpt)
        return model, trainer

    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):
        plain, _ = resume([])  # today: the suite without the float32 run's headroom history
    assert plain.nonfinite == 8  # every float16 step overflows
    guarded, trainer = resume([PrecisionHeadroom()])
    assert guarded.nonfinite == 0
    (record,) = get_engine(trainer).sink.records
    assert record.step == 8  # decided at the resume, from the float32 run's history, before the first step
    assert record.where == "fc2"
    assert json.loads(json.dumps(record.to_dict()))["values"]["bits"] < 0


class PassingDrift(ClassHead):
    """The unused logits run away for 35 steps, then shrink back to where they began."""

    def drift(self) -> None:
        factor = 1.15 if self.global_step <= 35 else 0.8
        if factor < 1 and float(self.head.bias[10:].abs().max()) < 100:
            return
        self.head.weight[10:] *= factor
        self.head.bias[10:] *= factor


def test_a_promotion_is_undone_once_its_headroom_has_recovered(tmp_path: Any) -> None:
    from lightning_nanguard.recovery.promote import is_promoted

    model = PassingDrift()
    callback = PrecisionHeadroom(every_n_steps=10, demote_after=3)
    trainer = _fit(tmp_path, model, "16-mixed", [callback], max_steps=110)
    assert model.nonfinite == 0
    actions = [(str(r.trigger), r.where, [str(a) for a in r.actions]) for r in get_engine(trainer).sink.records]
    assert actions == [("headroom_forecast", "head", ["promote"]), ("headroom_recovered", "head", ["demote"])]
    assert callback.promoted == []
    assert not is_promoted(model.head)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "bfloat16"), ("16-true", "float16")])
def test_where_nothing_can_be_promoted_headroom_is_reported_only(tmp_path: Any, precision: str, dtype: str) -> None:
    # bf16-mixed: float32's range (the runaway logits never come close); 16-true: no autocast to switch off.
    model = ClassHead()
    callback = PrecisionHeadroom(every_n_steps=5)
    trainer = _fit(tmp_path, model, precision, [callback], max_steps=30)
    assert callback.promoted == []
    assert get_engine(trainer).sink.records == []
    (line,) = callback.watch.summary_lines()
    assert line.startswith("closest to overflow: head, ")
    assert f"({dtype} headroom at the last sample)" in line
    lowest = callback.watch.lowest(1)[0][1]
    assert lowest > 100 if dtype == "bfloat16" else 0 < lowest < 6
    # No GradScaler under 16-true: each module's parameter gradients are sampled there too (bf16-mixed: covered).
    gradients = {name for name in callback.watch.book.modules if name.endswith(" (gradient)")}
    assert gradients == (set() if precision == "bf16-mixed" else {"body.0 (gradient)", "head (gradient)"})
