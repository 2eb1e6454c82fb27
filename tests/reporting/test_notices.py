"""nanguard's notices: a warning is a NanGuardWarning attributed to the user's line that started the run (no path into
nanguard or Lightning), a note is a plain log line."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch

from lightning_nanguard import FP32Evaluation, NanGuardWarning, NonFiniteTrainingError, OptimizerBackoff
from tests.fp32_eval_models import HalfOverflowModel
from tests.helpers import TinyModel, make_trainer


def test_a_warning_points_at_the_users_fit_call(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, "32-true", callbacks=[FP32Evaluation("always")], limit_val_batches=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(HalfOverflowModel(), verbose=False)
    ours = [w for w in caught if issubclass(w.category, NanGuardWarning)]
    assert [str(w.message)[:38] for w in ours] == ["FP32Evaluation has nothing to do: the "]
    assert ours[0].filename == __file__  # this test's `trainer.validate(...)` line, not a nanguard file
    assert issubclass(NanGuardWarning, UserWarning)  # pytest.warns(UserWarning) and old filters still see them


def test_a_hazard_is_a_warning_and_a_note_is_a_log_line(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    class HalfAdam(TinyModel):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16

    trainer = make_trainer(tmp_path, "16-true", callbacks=[OptimizerBackoff(on_hazard="warn")], max_steps=1)
    with (
        caplog.at_level(logging.INFO),
        pytest.warns(NanGuardWarning, match="eps=1e-08 is 0 in float16") as record,
        pytest.raises(NonFiniteTrainingError),  # warned, not fixed: the first update divides by zero
    ):
        trainer.fit(HalfAdam())
    assert all(w.filename == __file__ for w in record if issubclass(w.category, NanGuardWarning))
    # The true-half note ("no float32 master copy") is a plain line, not a warning.
    assert not [w for w in record if "master copy" in str(w.message)]
    assert any("no float32 master copy" in r.getMessage() for r in caplog.records)
