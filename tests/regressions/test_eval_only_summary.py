"""The summary after ``trainer.validate()``/``test()`` on a Trainer with the preset (issue 30): those runs have no
training step, and the summary said the steps were not checked because GradNormMonitor and AutoRollback are not
installed, which they were. It now says what the run was, and nothing about step monitors."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from lightning_nanguard import default_callbacks
from tests.helpers import TinyModel, make_trainer


class WithTestStep(TinyModel):
    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return self.validation_step(batch, batch_idx)


def _summaries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("nanguard summary")]


def test_an_evaluation_after_fit_says_no_training_step_ran_in_it(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model = WithTestStep()
    trainer = make_trainer(tmp_path, callbacks=default_callbacks(), limit_val_batches=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
        (fit,) = _summaries(caplog)
        caplog.clear()
        trainer.validate(model, verbose=False)
        trainer.test(model, model.val_dataloader(), verbose=False)
    assert "all 6 training steps were checked" in fit
    validate, test = _summaries(caplog)
    assert validate.splitlines()[2] == "no incidents in validate (no training step runs in it)."
    assert test.splitlines()[2] == "no incidents in test (no training step runs in it)."
    assert not any("none of the installed callbacks watches them" in s for s in (validate, test))
