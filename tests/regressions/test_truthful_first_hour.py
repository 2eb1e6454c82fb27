"""What the user is told is true: the new-user trial of issue 25 (round 3) and the round-2 re-runs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from lightning_nanguard import OptimizerBackoff
from lightning_nanguard.engine import get_engine
from tests.helpers import TinyModel, make_trainer


def _summary(caplog: pytest.LogCaptureFixture) -> str:
    (text,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nanguard summary")]
    return text


def test_true_half_precision_note_names_no_cause(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # "no float32 master copy" is a note about the setup: nothing overflowed, so it is no half_precision_overflow.
    trainer = make_trainer(tmp_path, "16-true", callbacks=[OptimizerBackoff()], max_steps=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyModel(optimizer="sgd", lr=0.01))
    (note,) = get_engine(trainer).sink.records
    assert (note.trigger, note.action, note.cause) == ("half_master", "preflight", None)
    assert note.to_dict()["cause"] == ""
    summary = _summary(caplog)
    assert "incidents: 1 (half_master=1)" in summary
    assert "half_precision_overflow" not in summary
