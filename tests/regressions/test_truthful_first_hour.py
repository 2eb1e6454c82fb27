"""What the user is told is true: the new-user trial of issue 25 (round 3) and the round-2 re-runs."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback, GradNormMonitor, NonFiniteTrainingError, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
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


def test_final_state_line_counts_the_names_it_leaves_out(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # on_nonfinite="warn" lets a NaN update through: all four tensors end non-finite, and nothing can restore them.
    callbacks = [GradNormMonitor(on_nonfinite="warn", forensics="off"), FaultInjector("loss", steps=[4])]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=6)
    with (
        caplog.at_level(logging.INFO),
        pytest.warns(UserWarning, match="let the update through"),
        pytest.raises(NonFiniteTrainingError) as raised,
    ):
        trainer.fit(TinyModel())
    line = next(x for x in _summary(caplog).splitlines() if x.startswith("final parameters and buffers"))
    assert line == "final parameters and buffers: NON-FINITE (body.0.bias, body.0.weight, head.bias and 1 more)"
    # What was tried is said as it was: the run only warned (not "nothing yet").
    assert "Tried in this run: only warned, 2 time(s)." in str(raised.value)  # at step 4, then step 5


@pytest.mark.parametrize(
    ("faults", "callbacks", "source"),
    [
        # Skip, then stop: nothing restores a damaged state.
        (FaultInjector("param", steps=[3]), lambda: [GradNormMonitor()], "GradNormMonitor"),
        # Found by the snapshot check: rolled back; the second damage spends AutoRollback's budget, which ends
        # training (restored first).
        (
            FaultInjector("param", steps=[3, 5]),
            lambda: [GradNormMonitor(), AutoRollback(max_rollbacks=1, every_n_steps=1, quiet_steps=0)],
            "AutoRollback",
        ),
    ],
)
def test_an_incident_names_the_callbacks_that_acted(tmp_path: Any, faults: Any, callbacks: Any, source: str) -> None:
    trainer = make_trainer(tmp_path, callbacks=[faults, *callbacks()], max_steps=8)
    with pytest.raises(NonFiniteTrainingError):
        trainer.fit(TinyModel())
    last = get_engine(trainer).sink.records[-1]
    assert "stop" in last.actions
    assert last.source == source  # not "..., nanguard"


class ManualModel(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_replays_a_nan_without_stepping_anything(tmp_path: Any) -> None:
    # Automatic optimization replays the batch (finite again: transient); under manual optimization the replay runs
    # training_step with its optimizer calls standing in (forensics.manual: nothing is stepped), and reads the same.
    causes = {}
    for model in (TinyModel(), ManualModel()):
        trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor(), FaultInjector("loss", steps=[3])])
        trainer.fit(model)
        (incident,) = get_engine(trainer).sink.records
        causes[model.automatic_optimization] = str(incident.cause)
        assert trainer.global_step == 6  # the replay stepped no optimizer (a manual step counts one)
    assert causes == {True: "transient", False: "transient"}


class BadRecordModel(TinyModel):
    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        x[11, 3] = float("nan")  # one broken record, in batch 1
        y = x[:, :1] * 0.5 - x[:, 1:2] * 0.25
        return DataLoader(TensorDataset(x, torch.nan_to_num(y)), batch_size=self.batch_size)


def test_a_data_cause_is_caused_by_data(tmp_path: Any) -> None:
    # The record read `cause: input_data` next to `caused_by_data: false`.
    trainer = make_trainer(tmp_path, callbacks=[GradNormMonitor()], max_steps=4)
    trainer.fit(BadRecordModel())
    (incident,) = get_engine(trainer).sink.records
    record = incident.to_dict()
    assert record["cause"] == "input_data"
    assert record["diagnosis"]["caused_by_data"] is True  # type: ignore[index]
