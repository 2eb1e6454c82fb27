"""A fault no remedy of nanguard fixes is bounded and explained, not looped on (issue 24).

The fault: a hand-written binary cross-entropy on sigmoid probabilities under bf16. Once the model is confident,
``p`` rounds to 1.0 (or 0.0) in bfloat16 and ``log(1 - p)`` is ``-inf``: the loss is NaN on every batch holding a
confident sample, from then on. The origin of the first NaN names it (``low_precision_rounding``, at the log's
line, with the logits-based form as the fix). Dropping the update (and quarantining the records that triggered it) is
all nanguard can do; a lower learning rate fixes nothing.
Unguarded by a budget, such a run dropped a third of its updates and halved its learning rate at each recurrence.

Promised: the learning rate is never lowered for it; its incidents are one record with a count; the dropped updates
count against a budget (a share of recent steps), after which training stops with the diagnosis and the fix, or,
with ``on_dropped_budget="warn"``, goes on with one loud warning.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor, NonFiniteTrainingError, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.engine.sink import INCIDENTS_FILE, SUMMARY_FILE
from lightning_nanguard.reporting.incidents import IncidentLog
from tests.helpers import all_finite, make_trainer

LR = 0.5
CAUSE = "low_precision_rounding"


class ConfidentBCE(pl.LightningModule):
    """Logistic regression on separable data with a hand-written BCE: confident within one epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        p = torch.sigmoid(self.net(x)).squeeze(-1)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 4, generator=g)
        y = (x[:, 0] > 0).float()
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=g)


def _fit(tmp_path: Any, monitor: GradNormMonitor) -> tuple[pl.Trainer, OptimizerBackoff, str]:
    """Fit; the stop error's message, ``""`` when fit returned."""
    torch.manual_seed(0)
    backoff = OptimizerBackoff(skips_before_backoff=2)
    logger = CSVLogger(str(tmp_path), name="logs", version=0)
    trainer = make_trainer(
        tmp_path, precision="bf16-true", logger=logger, max_steps=-1, max_epochs=4, callbacks=[monitor, backoff]
    )
    model = ConfidentBCE()
    error = ""
    try:
        trainer.fit(model)
    except NonFiniteTrainingError as err:
        error = str(err)
    assert all_finite(model)
    assert backoff.lr_scale == 1.0  # never lowered: a lower learning rate does not fix a loss formula
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR
    return trainer, backoff, error


def _logged(tmp_path: Any, name: str) -> str:
    return os.path.join(tmp_path, "logs", "version_0", name)


def test_a_loss_that_is_nan_once_the_model_is_confident_stops_after_the_dropped_updates_budget(tmp_path: Any) -> None:
    monitor = GradNormMonitor(max_dropped_fraction=0.1, dropped_window=50)  # 5 drops allowed in any 50 steps
    trainer, _, message = _fit(tmp_path, monitor)
    assert "Cause: low precision rounding at aten.log.default" in message
    assert "6 of the last 50 updates were dropped, more than max_dropped_fraction=0.1" in message
    assert "compute the loss from the logits" in message  # the fix
    assert "max_dropped_fraction" in message.split("What to try:")[1]
    records = [r for r in get_engine(trainer).sink.records if r.cause == CAUSE]
    # The five drops the budget allowed, each the same fault at the same line: recurring records (one for those
    # whose triggering records were quarantined, one for the rest), then the stop.
    assert sum(r.count for r in records) == 6
    assert records[-1].actions == ["skip", "stop"]
    assert records[-1].count == 1
    assert len(records) < 5
    assert any(r.count > 1 for r in records)
    assert all(r.where.startswith("aten.log.default (forward) at ") for r in records)
    assert max(r.last_step for r in records[:-1]) < records[-1].step
    # The log on disk reads back as the same records (the repeats folded in), line by line in order.
    on_disk = [r for r in IncidentLog.read(_logged(tmp_path, INCIDENTS_FILE)) if r.cause == CAUSE]
    assert [(r.step, r.count, r.last_step) for r in on_disk] == [(r.step, r.count, r.last_step) for r in records]


def test_the_budget_in_warn_mode_goes_on_with_one_warning_and_the_fault_is_one_record(tmp_path: Any) -> None:
    monitor = GradNormMonitor(max_dropped_fraction=0.1, dropped_window=50, on_dropped_budget="warn")
    with pytest.warns(UserWarning, match="kept training past the dropped-updates budget") as warned:
        trainer, _, error = _fit(tmp_path, monitor)
    assert sum("dropped-updates budget" in str(w.message) for w in warned) == 1
    assert not error
    assert trainer.global_step == 128  # the whole run
    records = [r for r in get_engine(trainer).sink.records if r.cause == CAUSE]
    # The warning is one record (its actions differ); the other drops recur in a few, never one per step.
    assert [r.actions for r in records].count(["skip", "warn"]) == 1
    assert len(records) < 6
    dropped = sum(r.count for r in records)
    assert dropped == monitor.skipped_steps > 10  # past the budget of 5, in the warn mode
    with open(_logged(tmp_path, SUMMARY_FILE), encoding="utf-8") as f:
        summary = f.read()
    first = max(records, key=lambda r: r.count)
    assert f"{first.count} times between steps {first.step} and {first.last_step}" in summary
    assert "still recurring when training ended: not fixed" in summary
