"""The probe compares like with like: an objective that changes with the step is not a divergence.

A verdict compares the current weights with the reference snapshot's weights on the same probe rows, under the same
objective, at the same moment (the snapshot's weights are loaded into the module for a second scoring, then the
current ones put back bit for bit). A curriculum stage that adds a loss term and a loss weight ramped by a schedule
raise the loss and spike the gradient norm; both get no intervention under ``default_callbacks()``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback, OptimizerBackoff, default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.recovery.probe_weights import snapshot_weights
from lightning_nanguard.recovery.snapshot import SnapshotRing

pytestmark = pytest.mark.timeout(120)

LR = 0.02
STAGE = 120


class Staged(pl.LightningModule):
    """An MLP whose objective depends on ``global_step``: ``"stage"`` adds an auxiliary term from step 120 on,
    ``"ramp"`` weighs that term by a weight ramped from 0 to 4 over steps 100-110."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self.net(x)
        loss = nn.functional.mse_loss(out[:, 0], y)
        if self.kind == "stage" and self.global_step >= STAGE:
            loss = loss + 4.0 * nn.functional.mse_loss(out[:, 1], y.abs() * 3)
        if self.kind == "ramp":  # a KL-annealing-like weight: 0 before step 100, 4 from step 110 on
            weight = 4.0 * min(1.0, max(0.0, (self.global_step - 100) / 10))
            loss = loss + weight * nn.functional.mse_loss(out[:, 1], y.abs() * 3)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


@pytest.mark.parametrize("kind", ["stage", "ramp"])
def test_an_objective_that_changes_with_the_step_gets_no_intervention(kind: str, tmp_path: Any) -> None:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    callbacks = default_callbacks(CheckpointGuard=False)
    trainer = pl.Trainer(
        max_steps=200,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Staged(kind), DataLoader(TensorDataset(x, x[:, :3].sum(1)), batch_size=32, shuffle=True))
    rollback = next(c for c in callbacks if isinstance(c, AutoRollback))
    backoff = next(c for c in callbacks if isinstance(c, OptimizerBackoff))
    assert get_engine(trainer).sink.records == []
    assert (rollback.rollbacks, backoff.lr_scale) == (0, 1.0)
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR
    verdict = rollback.probe.verdict
    assert verdict is not None  # the change spiked, and the spike was probed
    assert verdict.same_moment  # the reference snapshot's weights were scored at the spike, under its objective
    assert not verdict.rose


def test_a_snapshots_weights_are_loaded_for_a_block_and_the_current_ones_put_back_bit_for_bit() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(16, 4)).sum().backward()
    opt.step()
    ring = SnapshotRing(2)
    ring.take(module, [opt], step=10, log_step=10)
    taken = {k: v.clone() for k, v in module.state_dict().items()}
    opt_state = [s["exp_avg"].clone() for s in opt.state.values()]
    module(torch.randn(16, 4)).sum().backward()
    opt.step()  # the weights move on, and the BatchNorm statistics
    now = {k: v.clone() for k, v in module.state_dict().items()}
    trainer: Any = None  # a single process: the restore needs no collective
    with snapshot_weights(ring, 10, trainer, module) as loaded:
        assert loaded
        assert all(torch.equal(v, taken[k]) for k, v in module.state_dict().items())
    assert all(torch.equal(v, now[k]) for k, v in module.state_dict().items())
    assert not all(torch.equal(a, s["exp_avg"]) for a, s in zip(opt_state, opt.state.values(), strict=True))
    with snapshot_weights(ring, 20, trainer, module) as loaded:  # no such snapshot: nothing changes
        assert not loaded
    module.add_module("extra", nn.Linear(1, 1))  # the module changed since: the snapshot does not match it
    with snapshot_weights(ring, 10, trainer, module) as loaded:
        assert not loaded
