"""No remedy that costs more than the fault (issue 24): roll back no further than the last sound state, and let a cut
learning rate come back when its cause is gone.

* Buffers a batch's forward wrote non-finite (BatchNorm statistics folding an fp16 overflow), with the parameters
  and the optimizer state sound, are restored alone: no step of training is undone and no rollback budget is spent,
  however many batches of a shuffled bad shard do it (each one's rows quarantined).
* ``OptimizerBackoff(recover_with_schedule=True)`` (the preset's): a rate cut during a warm restart comes back as the
  schedule falls below the rate that was cut, and never rises above it.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback, GradNormMonitor, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import all_finite, make_trainer, params_of


class NormNet(pl.LightningModule):
    """Linear -> BatchNorm -> Tanh -> Linear, on rows whose feature 0 is the sample index; ``shard`` rows x1e5."""

    def __init__(self, shard: list[int], shuffle: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.shard, self.shuffle = shard, shuffle
        self.params_before: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.params_before[self.trainer.global_step] = params_of(self.net)
        return nn.functional.mse_loss(self.net(x[:, 1:]).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=g)
        y = x[:, 1:2] - x[:, 2:3]
        x[:, 0] = torch.arange(128, dtype=torch.float32)
        x[self.shard, 1:] *= 1e5  # a shard recorded in other units: the fp16 forward overflows
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=self.shuffle, generator=g)


def _buffers_finite(model: pl.LightningModule) -> bool:
    return all(bool(torch.isfinite(b).all()) for b in model.buffers() if b.is_floating_point())


def test_buffers_a_batch_poisoned_are_restored_alone_and_no_step_is_undone(tmp_path: Any) -> None:
    model = NormNet(shard=list(range(40, 48)))  # half of batch 2
    rollback = AutoRollback(every_n_steps=1)
    callbacks = [GradNormMonitor(), rollback]
    trainer = make_trainer(tmp_path, precision="16-mixed", callbacks=callbacks, max_steps=6)
    trainer.fit(model)
    (record,) = get_engine(trainer).sink.records
    assert (record.step, record.cause, record.actions) == (
        2,
        "corrupt_state",
        ["scaler_skip", "quarantine", "rollback"],
    )
    assert record.values["steps_lost"] == 0
    assert record.values["repaired"] == ["net.1.running_mean", "net.1.running_var"]
    assert "restored the buffers net.1.running_mean, net.1.running_var from the snapshot of step 2" in record.message
    # The parameters went on from where they were: the step after the incident starts from the incident step's own.
    assert all(torch.equal(model.params_before[3][k], model.params_before[2][k]) for k in model.params_before[2])
    assert rollback.rollbacks == 0  # no rollback: its budget is whole
    assert _buffers_finite(model)
    assert all_finite(model)


def test_a_shuffled_bad_shard_poisoning_batchnorm_in_every_batch_is_survived_without_the_rollback_budget(
    tmp_path: Any,
) -> None:
    # 16 bad rows shuffled over the 8 batches of an epoch: more repairs than max_rollbacks=2 allows rollbacks.
    model = NormNet(shard=list(range(48, 64)), shuffle=True)
    rollback = AutoRollback(every_n_steps=4, max_rollbacks=2)
    monitor = GradNormMonitor()
    trainer = make_trainer(tmp_path, precision="16-mixed", callbacks=[monitor, rollback], max_steps=-1, max_epochs=3)
    trainer.fit(model)
    records = get_engine(trainer).sink.records
    assert len(records) > 2
    assert all(r.cause == "corrupt_state" and r.values["steps_lost"] == 0 for r in records)
    assert rollback.rollbacks == 0
    assert set(monitor.quarantined_samples) <= set(range(48, 64))
    assert records[-1].epoch == 0  # each bad row once: every one quarantined in the first epoch
    assert _buffers_finite(model)


class LR(Callback):
    """The learning rate each step runs with."""

    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lr[trainer.global_step] = float(trainer.optimizers[0].param_groups[0]["lr"])


class Restart(pl.LightningModule):
    """A cosine schedule over 24 steps with a warm restart to 4x at steps 6-9."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(192, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


def schedule(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * step / 24)) * (4.0 if 6 <= step < 10 else 1.0)


@pytest.mark.parametrize("follow", [True, False])
def test_a_rate_cut_during_a_warm_restart_comes_back_as_the_schedule_falls_below_it(
    tmp_path: Any, follow: bool
) -> None:
    # A gradient spike at step 7, inside the restart: the rate is halved there (0.5 x 4 x cosine(7)).
    lrs = LR()
    backoff = OptimizerBackoff(skips_before_backoff=1, recover_with_schedule=follow)
    callbacks = [
        FaultInjector("grad", steps=[7], value=1e6),
        GradNormMonitor(spike_zscore=40.0, spike_warmup=1, on_spike="skip"),
        backoff,
        lrs,
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=24)
    trainer.fit(Restart())
    assert [(r.step, r.actions) for r in get_engine(trainer).sink.records] == [(7, ["skip", "backoff"])]
    cap = 0.01 * schedule(7) * 0.5  # one notch below the rate the spiking step ran with
    after = {s: lr for s, lr in lrs.lr.items() if s >= 8}
    if not follow:  # the plain backoff: half the schedule for good
        assert after == pytest.approx({s: 0.005 * schedule(s) for s in after})
        assert backoff.lr_scale == 0.5
        return
    assert all(lr <= cap * (1 + 1e-6) for lr in after.values())  # never above the rate the backoff left
    # After the restart the schedule falls below the cap: the rate is the schedule's own again.
    back = [s for s in after if 0.01 * schedule(s) <= cap]
    assert back
    assert back[0] == 10
    assert all(after[s] == pytest.approx(0.01 * schedule(s)) for s in back)
    assert backoff.lr_scale == 1.0
