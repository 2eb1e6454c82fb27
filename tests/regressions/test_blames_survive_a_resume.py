"""The chains of data hypotheses travel in the checkpoint: a resumed run ends with the uninterrupted run's quarantine.

A formula that cannot take some valid records (``torch.log`` of a target that is 0 for records 3 and 11) blames
record 3 at step 0 as a hypothesis and quarantines it; record 11 meets the same op at the same line two steps later,
which withdraws the blame and releases record 3. Resumed from a checkpoint taken between the two, the chain was not
saved: record 11 started a new chain, and both valid records stayed quarantined for good. The chains are now
GradNormMonitor's saved state (``"blames"``, versioned, validated on load).
"""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_nanguard import CheckpointVerificationError, GradNormMonitor, default_callbacks
from lightning_nanguard.policies.withdrawal import STATE_VERSION, Blames, Chain
from tests.helpers import make_trainer

# The resume is mid-epoch, as a preemption's is (the blame is at step 0, its withdrawal at step 2 of 2 per epoch).
pytestmark = pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")


class Records(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(16, 4, generator=g)
        self.y = torch.rand(16, generator=g) + 0.5
        self.y[3] = 0.0  # valid records the formula below cannot take
        self.y[11] = 0.0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class LogTarget(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x).squeeze(1) - torch.log(y)) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(root: Any, max_steps: int, ckpt: str | None = None) -> tuple[pl.Trainer, GradNormMonitor]:
    pl.seed_everything(0, verbose=False)
    callbacks = default_callbacks(CheckpointGuard=False)
    trainer = make_trainer(root, max_steps=max_steps, callbacks=callbacks, logger=True)
    trainer.fit(LogTarget(), DataLoader(Records(), batch_size=8), ckpt_path=ckpt)
    monitor = next(c for c in callbacks if isinstance(c, GradNormMonitor))
    return trainer, monitor


def _interrupted(tmp_path: Any) -> str:
    trainer, monitor = _fit(tmp_path / "resumed", 1)
    assert monitor.quarantined_samples == [3]  # the blame, still a hypothesis
    path = str(tmp_path / "preempted.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_a_resumed_run_withdraws_a_blame_made_before_the_resume(tmp_path: Any) -> None:
    _, straight = _fit(tmp_path / "straight", 4)
    assert straight.quarantined_samples == []
    path = _interrupted(tmp_path)
    saved = torch.load(path, weights_only=True)["callbacks"]["GradNormMonitor"]["blames"]
    assert saved["version"] == STATE_VERSION
    assert [c["steps"] for c in saved["chains"]] == [[0]]
    _, resumed = _fit(tmp_path / "resumed", 4, path)
    assert resumed.quarantined_samples == straight.quarantined_samples == []
    file = tmp_path / "resumed" / "lightning_logs" / "version_1" / "nanguard" / "quarantine.json"
    assert json.loads(file.read_text(encoding="utf-8"))["samples"] == []


@pytest.mark.parametrize(
    ("blames", "match"),
    [
        ("chains", "not a dict"),
        ({"version": 99, "chains": []}, "format 99"),
        ({"version": STATE_VERSION, "chains": {"a": 1}}, "'chains' is not a list"),
        ({"version": STATE_VERSION, "chains": [{"cause": "x", "place": "y", "steps": ["0"]}]}, "'steps'"),
        ({"version": STATE_VERSION, "chains": [], "lines": [1]}, "'lines'"),
    ],
)
def test_malformed_blames_in_a_checkpoint_are_a_verification_error(tmp_path: Any, blames: Any, match: str) -> None:
    path = _interrupted(tmp_path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["callbacks"]["GradNormMonitor"]["blames"] = blames
    torch.save(ckpt, path)
    with pytest.raises(CheckpointVerificationError, match=match):
        _fit(tmp_path / "resumed", 4, path)
    with pytest.raises(CheckpointVerificationError, match="blames"):
        GradNormMonitor().load_state_dict({"blames": blames})  # before a fit: validated at once


def test_blames_round_trip_through_their_state() -> None:
    blames = Blames()
    blames.chains[("exp_overflow", "aten.exp at m.py:3")] = Chain([4, 9], [("0", 34)], ["ab12"], 9, True)
    blames.lines.append("step 9: released")
    back = Blames()
    back.load_state_dict(blames.state_dict())
    assert back.chains == blames.chains
    assert back.lines == blames.lines
