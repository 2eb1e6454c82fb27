"""One nanguard callback of each kind per Trainer: a second one is refused before any step and before any summary,
with nanguard's error naming both and what to do (new-user trial: `[*default_callbacks(), GradNormMonitor(
layer_depth=2)]` was accepted silently, and a refusal came after a summary that claimed every step was checked)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

from lightning_nanguard import (
    AutoRollback,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    NanGuardConfigError,
    OptimizerBackoff,
    default_callbacks,
)
from tests.helpers import TinyModel, make_trainer


class CountingModel(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.steps_run = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.steps_run += 1
        return super().training_step(batch, batch_idx)


# A second callback of each kind, with settings that differ from the preset's. Every nanguard callback saves its
# state under its class name (so that a resume with other arguments keeps it): Lightning refuses the list when the
# Trainer is built; a list changed after that is nanguard's to refuse at setup.
SECOND: list[tuple[Callback, str, str]] = [
    (
        GradNormMonitor(layer_depth=2),
        "GradNormMonitor(spike_zscore=3.0, spike_warmup=10, on_spike='probe')",
        "GradNormMonitor(layer_depth=2)",
    ),
    (AutoRollback(every_n_steps=7), "AutoRollback()", "AutoRollback(every_n_steps=7)"),
    (
        OptimizerBackoff(lr_factor=0.25),
        "OptimizerBackoff(recover_with_schedule=True)",
        "OptimizerBackoff(lr_factor=0.25)",
    ),
    (LossScaleWatchdog(min_scale=2.0), "LossScaleWatchdog()", "LossScaleWatchdog(min_scale=2.0)"),
    (
        FP32Evaluation(mode="always"),
        "FP32Evaluation(mode='on_nonfinite', promote_after=2)",
        "FP32Evaluation()",
    ),
]


@pytest.mark.parametrize(("second", "first_text", "second_text"), SECOND, ids=lambda v: type(v).__name__)
def test_a_second_callback_of_a_kind_is_refused_before_any_step(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, second: Callback, first_text: str, second_text: str
) -> None:
    name = type(second).__name__
    with pytest.raises(RuntimeError, match=f"Found more than one stateful callback of type `{name}`"):
        make_trainer(tmp_path, "bf16-mixed", callbacks=[*default_callbacks(), second])
    model = CountingModel()
    trainer = make_trainer(tmp_path, "bf16-mixed", callbacks=default_callbacks(), limit_val_batches=2)
    trainer.callbacks.append(second)
    with caplog.at_level(logging.INFO), pytest.raises(NanGuardConfigError) as raised:
        trainer.fit(model)
    message = str(raised.value)
    assert f"Two {name} callbacks are installed on one Trainer: {first_text} and {second_text}." in message
    if name == "GradNormMonitor":
        assert "default_callbacks(GradNormMonitor={'layer_depth': 2})" in message  # what to do instead
    assert model.steps_run == 0  # refused before any step
    assert not [r for r in caplog.records if "nanguard summary" in r.getMessage()]  # and with no summary


def test_two_with_the_same_settings_are_refused_too(tmp_path: Any) -> None:
    with pytest.raises(RuntimeError, match="Found more than one stateful callback of type `GradNormMonitor`"):
        make_trainer(tmp_path, callbacks=[GradNormMonitor(), GradNormMonitor()])
    # A list changed after the Trainer was built is not checked by Lightning: nanguard refuses it at setup.
    model = CountingModel()
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()])
    trainer.callbacks.append(GradNormMonitor())
    with pytest.raises(NanGuardConfigError, match=r"GradNormMonitor\(\) and GradNormMonitor\(\) \(the same settings\)"):
        trainer.fit(model)
    assert model.steps_run == 0


def test_a_subclass_counts_as_its_kind(tmp_path: Any) -> None:
    class MyMonitor(GradNormMonitor):
        pass

    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(), MyMonitor(layer_depth=3)])
    with pytest.raises(NanGuardConfigError, match=r"GradNormMonitor\(\) and GradNormMonitor\(layer_depth=3\)"):
        trainer.fit(CountingModel())
