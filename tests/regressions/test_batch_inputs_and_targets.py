"""Which parts of a batch are inputs and which are targets (``signals.batch.split_batch``), on real fits (issues 24
and 25): a NaN regression target is a target problem, and a one-logit classifier's 0/1 labels are not class indices.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.engine import get_engine
from lightning_nanguard.signals.batch import read_batch, split_batch
from lightning_nanguard.testing import FaultInjector
from tests.helpers import all_finite, make_trainer


class Binary(pl.LightningModule):
    """The textbook binary classifier: one logit, BCE-with-logits, integer 0/1 labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self.net(x).squeeze(-1), y.float())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


# repro: binary_logit_int_labels_blamed_as_bad_targets.py
def test_a_one_logit_classifier_with_0_1_labels_is_not_blamed_for_its_targets(tmp_path: Any) -> None:
    # A transient fault (one NaN gradient) on a batch whose labels hold 1s: with one output, 1 is not "a class index
    # >= the output size". The replay shows the fault does not recur: skip only, no label quarantined.
    monitor = GradNormMonitor(forensics="every")
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=[FaultInjector("grad", steps=[2]), monitor])
    model = Binary()
    trainer.fit(model)
    assert [(r.step, r.cause, r.actions) for r in get_engine(trainer).sink.records] == [(2, "transient", ["skip"])]
    assert monitor.quarantined_samples == []
    assert all_finite(model)


class NaNTarget(pl.LightningModule):
    """A regression whose float target of sample 11 is NaN (a broken label), inputs all finite."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        y = x[:, :1] - x[:, 1:2]
        y[11] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=8)


def test_a_nan_regression_target_is_a_target_problem_not_an_input_one(tmp_path: Any) -> None:
    monitor = GradNormMonitor()
    trainer = make_trainer(tmp_path, max_steps=8, callbacks=[monitor])  # two epochs: the sample comes back once
    model = NaNTarget()
    trainer.fit(model)
    (incident,) = get_engine(trainer).sink.records  # the second epoch leaves the sample out: no second incident
    assert (incident.step, incident.cause, incident.actions) == (1, "targets", ["skip", "quarantine"])
    assert incident.where == "batch 1 rows [3]"
    evidence = incident.diagnosis["evidence"][0]
    assert (evidence["kind"], evidence["summary"]) == (
        "targets_nonfinite",
        "NaN/inf in the targets at batch 1 rows [3]",
    )
    assert "inputs" not in incident.message
    assert monitor.quarantined_samples == [11]
    assert all_finite(model)


@pytest.mark.parametrize(
    ("batch", "inputs", "targets"),
    [
        ((torch.zeros(2, 3), torch.zeros(2)), 1, 1),  # (x, y): the last part is the targets
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2)), 2, 1),  # (x, mask, y)
        ({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2)}, 1, 1),  # a mapping: by key
        ({"input_ids": torch.zeros(2, 3), "attention_mask": torch.zeros(2, 3)}, 2, 0),  # no target key: inputs only
        (torch.zeros(2, 3), 1, 0),  # one tensor: inputs only
        ((torch.zeros(2, 3),), 1, 0),  # a one-element tuple: inputs only
    ],
)
def test_the_input_and_target_rule(batch: Any, inputs: int, targets: int) -> None:
    found = split_batch(batch)
    assert (len(found[0]), len(found[1])) == (inputs, targets)


def test_a_single_output_never_checks_class_indices_but_two_do() -> None:
    y = torch.tensor([0, 1, 1, 0])
    assert read_batch((torch.zeros(4, 2), y), 1).target_rows == ()  # a binary logit (or a regression)
    assert read_batch((torch.zeros(4, 2), y + 1), 2).target_rows == (1, 2)  # class 2 of a 2-class head
