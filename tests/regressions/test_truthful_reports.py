"""Regressions, group E: what the user is told is true.

One test per script of ``../shared/repros/`` (group E of issue 12).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from lightning_nanguard import (
    AutoRollback,
    CheckpointGuard,
    GradNormMonitor,
    LossScaleWatchdog,
    NanGuardConfigError,
    NonFiniteTrainingError,
    OptimizerBackoff,
)
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer


# repro: stop_message_claims_finite_weights.py
def test_stop_message_describes_nonfinite_weights_as_they_are(tmp_path: pathlib.Path) -> None:
    model = TinyModel()
    callbacks = [FaultInjector("param", steps=[3]), GradNormMonitor(max_consecutive_skips=5)]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=12)
    with pytest.raises(NonFiniteTrainingError) as info:
        trainer.fit(model)
    assert not all_finite(model)
    message = str(info.value)
    assert "weights are finite" not in message
    assert "parameters and buffers are finite" not in message
    assert "NON-FINITE" in message
    assert "do not save or export this model" in message
    (incident,) = get_engine(trainer).sink.records
    assert "weights are finite" not in incident.message
    assert "NON-FINITE" in incident.message


def test_stop_message_says_finite_only_when_checked_finite(tmp_path: pathlib.Path) -> None:
    # The other side: a streak of bad batches with intact weights stops with a true "finite" statement.
    model = TinyModel()
    callbacks = [FaultInjector("loss", steps=range(2, 12)), GradNormMonitor(max_consecutive_skips=3)]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=12)
    with pytest.raises(NonFiniteTrainingError) as info:
        trainer.fit(model)
    assert all_finite(model)
    assert "parameters and buffers are finite (checked)" in str(info.value)
    assert "NON-FINITE" not in str(info.value)


# repro: summary_written_into_cwd.py
@pytest.mark.parametrize(
    "callbacks",
    [
        pytest.param(lambda: [GradNormMonitor()], id="GradNormMonitor"),
        pytest.param(lambda: [AutoRollback(), OptimizerBackoff(), LossScaleWatchdog()], id="three"),
        pytest.param(lambda: [FaultInjector("loss", steps=[1]), GradNormMonitor()], id="with-an-incident"),
    ],
)
@pytest.mark.filterwarnings("ignore:LossScaleWatchdog does nothing")
def test_fit_without_logger_or_checkpointing_writes_nothing_into_the_working_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, callbacks: Callable[[], list[Any]]
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    trainer = make_trainer(tmp_path, callbacks=callbacks(), default_root_dir=None, max_steps=3)
    trainer.fit(TinyModel())
    assert trainer.global_step == 3
    assert sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")) == []


# repro: constructor_validation_gaps.py
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: OptimizerBackoff(triggers=""), id="OptimizerBackoff-triggers-empty"),
        pytest.param(lambda: OptimizerBackoff(triggers=" , "), id="OptimizerBackoff-triggers-blank"),
        pytest.param(
            lambda: LossScaleWatchdog(min_scale=1e-50),
            id="LossScaleWatchdog-min_scale-below-float32",
        ),
        pytest.param(
            lambda: FaultInjector(ranks="1"),  # type: ignore[arg-type]
            id="FaultInjector-ranks-str",
        ),
        pytest.param(
            lambda: FaultInjector(ranks=-1),
            id="FaultInjector-ranks-negative",
        ),
        pytest.param(
            lambda: FaultInjector(param_name=0),  # type: ignore[arg-type]
            id="FaultInjector-param_name-int",
        ),
        pytest.param(
            lambda: FaultInjector(steps=None),  # type: ignore[arg-type]
            id="FaultInjector-steps-None",
        ),
    ],
)
def test_bad_constructor_arguments_are_refused_with_nanguard_config_error(make: Callable[[], Any]) -> None:
    with pytest.raises(NanGuardConfigError):
        make()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda: FaultInjector(steps=np.int64(3)),  # type: ignore[arg-type]
            id="FaultInjector-steps-numpy-int",
        ),
        pytest.param(
            lambda: FaultInjector(steps=[np.int64(3), 4]),  # type: ignore[list-item]
            id="FaultInjector-steps-numpy-list",
        ),
        pytest.param(lambda: AutoRollback(checkpoint_dir=pathlib.Path("ck")), id="AutoRollback-checkpoint_dir-Path"),  # type: ignore[arg-type]
        pytest.param(lambda: LossScaleWatchdog(min_scale=1e-30), id="LossScaleWatchdog-min_scale-small"),
        pytest.param(lambda: CheckpointGuard(), id="CheckpointGuard"),
    ],
)
def test_legitimate_constructor_arguments_are_accepted(make: Callable[[], Any]) -> None:
    make()


def test_fault_injector_ranks_as_intended_injects_on_that_rank(tmp_path: pathlib.Path) -> None:
    # The legitimate spellings the refused ones stand for still work: an int and a list of ints.
    for ranks in (0, [0]):
        injector, model = FaultInjector("loss", steps=[1], ranks=ranks), TinyModel()
        trainer = make_trainer(tmp_path, callbacks=[injector, GradNormMonitor()], max_steps=2)
        trainer.fit(model)
        assert injector.injected == [(1, "loss", 0)]
        assert not torch.isfinite(torch.tensor(model.losses[1])) or get_engine(trainer).sink.records
