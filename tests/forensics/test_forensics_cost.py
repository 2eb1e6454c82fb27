"""Forensics costs nothing on a healthy step, and its replays are bounded and costed on the incident path."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.forensics.models import RegressionNet
from tests.helpers import HostReadsPerStep, make_trainer


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_healthy_steps_read_the_host_as_often_with_forensics_as_without(tmp_path: Any, precision: str) -> None:
    counts = {}
    for mode in ("off", "first", "every"):
        counter = HostReadsPerStep()
        trainer = make_trainer(
            tmp_path / mode,
            precision,
            max_steps=6,
            log_every_n_steps=50,
            callbacks=[GradNormMonitor(forensics=mode), counter],
        )
        trainer.fit(RegressionNet())
        assert get_engine(trainer).sink.records == []
        counts[mode] = counter.per_step[1:]
    assert counts["off"] == counts["first"] == counts["every"]


class _StepTime(pl.Callback):
    """Stands in for the engine's step clock: a known step time makes the budget exact."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        get_engine(trainer).ledger.step_seconds = self.seconds


def test_replays_stop_at_max_replay_steps_and_each_is_costed(tmp_path: Any) -> None:
    # Step time 1 ms, max_replay_steps=1e-6: the first replay runs (nothing spent yet), then the budget is spent.
    trainer = make_trainer(
        tmp_path,
        max_steps=5,
        callbacks=[
            _StepTime(1e-3),
            FaultInjector("loss", steps=[1, 3]),
            GradNormMonitor(forensics="every", max_replay_steps=1e-6),
        ],
    )
    trainer.fit(RegressionNet())
    first, second = (r.diagnosis for r in get_engine(trainer).sink.records)
    assert first["replayed"]
    assert first["replay_steps"] == pytest.approx(first["replay_ms"] / 1.0)
    assert not second["replayed"]
    assert "replay budget is spent" in second["note"]
    assert get_engine(trainer).ledger.replays.spent_ms == pytest.approx(first["replay_ms"], rel=1e-3)
