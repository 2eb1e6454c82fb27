"""PrecisionHeadroom under 16-mixed: the loss-scaled gradient is sampled, and the GradScaler's scale is lowered by a
power of two before the float16 backward overflows.

fp16-explosion (SGD at twice its stable learning rate) overflows in the backward: at the GradScaler's 65536 the
largest weight gradient times the scale passes 65504 within 3-12 steps, one dropped step before AutoRollback's probe
catches the divergence. With the scale lowered to the margin at the first read, no step is dropped. On a healthy run
the cut changes no value: the same parameters to the last bit.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import LossScaleWatchdog, NanGuardConfigError, PrecisionHeadroom, default_callbacks
from lightning_nanguard.demo import run_task
from lightning_nanguard.engine import get_engine
from lightning_nanguard.reporting import keys
from lightning_nanguard.testing import HostReadCounter
from tests.callbacks.test_precision_headroom import ClassHead
from tests.helpers import TinyModel, make_trainer, params_of, tb_scalars

pytestmark = pytest.mark.timeout(180)

RATIO = 1.10  # the preset's final train loss against the healthy run's (measured: 1.055-1.076, 0.864 on seed 4)


def _preset(margin: float | None) -> list[pl.Callback]:
    return default_callbacks(PrecisionHeadroom={"scale_margin_bits": margin})


def _find(callbacks: list[Any], kind: type) -> Any:
    return next(c for c in callbacks if isinstance(c, kind))


def _plugins(init_scale: float = 65536.0) -> list[Any]:
    """The GradScaler as torch builds it by default (the test helpers start theirs at 1024)."""
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]


@pytest.mark.parametrize("seed", [0, 1, 2, 4])  # seed 3 does not overflow at 65536 either way
def test_fp16_explosion_drops_no_step_once_the_scale_is_lowered_in_time(tmp_path: Any, seed: int) -> None:
    root = str(tmp_path)
    healthy = run_task("fp16-explosion", [], seed=seed, root_dir=root, healthy=True)
    off = run_task("fp16-explosion", _preset(None), seed=seed, root_dir=root, config="scale-off")
    assert off.skipped_steps >= 1  # the fault is real: the GradScaler drops a step without the cut
    assert "half_precision_overflow" in off.incidents_by_cause

    callbacks = _preset(4.0)
    run = run_task("fp16-explosion", callbacks, seed=seed, root_dir=root, config="preset")
    assert run.finished, run.error
    assert run.skipped_steps == 0, run.actions()
    assert "half_precision_overflow" not in run.incidents_by_cause
    assert _find(callbacks, LossScaleWatchdog)._policy.overflow_steps == 0
    lowerings = _find(callbacks, PrecisionHeadroom).watch.scaled.lowerings
    assert lowerings.count >= 1
    assert lowerings.first_from == 65536.0
    assert run.train_loss <= RATIO * healthy.train_loss, (run.train_loss, healthy.train_loss)


def _tiny(tmp_path: Any, callbacks: list[Any], **kw: Any) -> tuple[TinyModel, pl.Trainer]:
    torch.manual_seed(0)
    model = TinyModel()
    trainer = make_trainer(tmp_path, "16-mixed", callbacks=callbacks, max_steps=40, plugins=_plugins(), **kw)
    trainer.fit(model)
    return model, trainer


def test_a_healthy_run_has_its_scale_lowered_and_the_same_parameters_to_the_last_bit(tmp_path: Any) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    plain, _ = _tiny(tmp_path / "plain", [])
    off, _ = _tiny(tmp_path / "off", _preset(None))
    callbacks = _preset(4.0)
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    guarded, trainer = _tiny(tmp_path / "guarded", callbacks, logger=logger, log_every_n_steps=5)
    # 1.5 bits at 65536 at the first sample (step 0): 3 halvings bring it to 4.5, read and done before step 1
    assert float(trainer.precision_plugin.scaler.get_scale()) == 8192.0  # type: ignore[attr-defined]
    assert params_of(guarded).keys() == params_of(plain).keys()
    for name, value in params_of(guarded).items():
        assert torch.equal(value, params_of(plain)[name]), name
        assert torch.equal(value, params_of(off)[name]), name
    assert get_engine(trainer).sink.records == []  # not an incident
    watchdog = _find(callbacks, LossScaleWatchdog)
    assert (watchdog._policy.overflow_steps, watchdog._policy.collapses) == (0, 0)
    scalars = tb_scalars(logger.log_dir)
    assert scalars[keys.LOSS_SCALE_LOWERED][-1][1] == 1.0
    assert scalars[keys.HEADROOM_SCALED_GRAD][-1][1] >= 4.0
    assert scalars[keys.LOSS_SCALE][-1][1] == 8192.0
    with open(os.path.join(logger.log_dir, "nanguard", "summary.txt"), encoding="utf-8") as f:
        summary = f.read()
    assert "loss scale lowered once, 8x in all (65536 -> 8192 in this fit), before a float16 gradient overflow" in (
        summary
    )


def test_the_scale_is_never_lowered_below_the_watchdog_floor(tmp_path: Any) -> None:
    callbacks = default_callbacks(LossScaleWatchdog={"min_scale": 32768.0})
    _, trainer = _tiny(tmp_path, callbacks)
    assert float(trainer.precision_plugin.scaler.get_scale()) == 32768.0  # type: ignore[attr-defined]
    assert _find(callbacks, PrecisionHeadroom).watch.scaled.lowerings.halvings == 1


def test_without_the_margin_the_scale_is_the_gradscalers(tmp_path: Any) -> None:
    callbacks = [PrecisionHeadroom(scale_margin_bits=None)]
    _, trainer = _tiny(tmp_path, callbacks)
    assert float(trainer.precision_plugin.scaler.get_scale()) == 65536.0  # type: ignore[attr-defined]
    watch = _find(callbacks, PrecisionHeadroom).watch.scaled
    assert watch.lowerings.count == 0
    assert watch.bits is not None  # still measured and reported
    assert watch.bits < 4.0


def test_under_gradient_accumulation_the_scale_is_left_alone(tmp_path: Any) -> None:
    # A cut between two backward passes of one update would mix two scales in its gradient.
    callbacks = [PrecisionHeadroom()]
    _, trainer = _tiny(tmp_path, callbacks, accumulate_grad_batches=2)
    assert float(trainer.precision_plugin.scaler.get_scale()) == 65536.0  # type: ignore[attr-defined]
    assert _find(callbacks, PrecisionHeadroom).watch.scaled.lowerings.count == 0


def test_sampling_the_scaled_gradient_and_lowering_the_scale_read_nothing_from_the_device(tmp_path: Any) -> None:
    def run(callbacks: list[Any]) -> tuple[ClassHead, int]:
        torch.manual_seed(0)
        model = ClassHead()
        model.drift = lambda: None  # type: ignore[method-assign]  # healthy
        trainer = make_trainer(tmp_path, "16-mixed", callbacks=callbacks, max_steps=24, plugins=_plugins())
        with HostReadCounter() as reads:
            trainer.fit(model)
        return model, reads.count

    _, plain_reads = run([LossScaleWatchdog()])
    callbacks = [LossScaleWatchdog(), PrecisionHeadroom(every_n_steps=8)]
    guarded, guarded_reads = run(callbacks)
    assert _find(callbacks, PrecisionHeadroom).watch.scaled.lowerings.count >= 1
    assert sum(1 for hooks in guarded.hooked_steps if hooks) < len(guarded.hooked_steps) // 2
    assert guarded_reads == plain_reads + 1  # the model's own ``float(loss)``, in the first step's trial


class Raw(pl.LightningModule):
    """A module with no submodule: its parameter used in ``training_step`` directly (no output to sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((8, 1), 0.1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss((x @ self.w).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :1] * 0.1), batch_size=8)


def test_the_gradient_is_sampled_where_no_module_output_is(tmp_path: Any) -> None:
    callback = PrecisionHeadroom()
    trainer = make_trainer(tmp_path, "16-mixed", callbacks=[callback], max_steps=8, plugins=_plugins())
    trainer.fit(Raw())
    assert callback.watch.book.modules == {}
    assert callback.watch.scaled.lowerings.count == 1  # 1.2 bits at 65536: 3 halvings
    assert float(trainer.precision_plugin.scaler.get_scale()) == 8192.0  # type: ignore[attr-defined]


def test_the_margin_is_validated() -> None:
    with pytest.raises(NanGuardConfigError, match="scale_margin_bits"):
        PrecisionHeadroom(scale_margin_bits=-1.0)
    assert PrecisionHeadroom(scale_margin_bits=None).config.scale_margin_bits is None
