"""AutoRollback in real Trainer.fit runs: restore exactness, recurrence, budget, requests, TensorBoard, disk."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_nanguard import (
    AutoRollback,
    GradNormMonitor,
    NanGuardConfigError,
    RecoveryBudgetExhausted,
    UnsupportedSetupError,
)
from lightning_nanguard.checkpointing.verify import SIDECAR_SUFFIX, verify_checkpoint, write_sidecar
from lightning_nanguard.contract import RestoreSource, StateRestored
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, loggers, make_trainer, params_of, tb_scalars


class StateSpy(pl.Callback):
    """Records parameters and AdamW state at every batch start, and every "restored" event."""

    def __init__(self) -> None:
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.moments: dict[int, list[torch.Tensor]] = {}
        self.restored: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        get_engine(trainer).bus.subscribe(StateRestored, lambda trainer, event: self.restored.append(event))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.params[trainer.global_step] = params_of(pl_module)
        opt = trainer.optimizers[0]
        self.moments[trainer.global_step] = [
            opt.state[p]["exp_avg"].clone() for p in pl_module.parameters() if "exp_avg" in opt.state[p]
        ]


def rollbacks(trainer: pl.Trainer) -> list[Any]:
    return [r for r in get_engine(trainer).sink.records if r.action == "rollback"]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_damaged_state_restores_newest_snapshot_bit_for_bit(tmp_path: Any, precision: str) -> None:
    spy, model = StateSpy(), TinyModel()
    rb = AutoRollback(every_n_steps=2, quiet_steps=0)
    trainer = make_trainer(tmp_path, precision, callbacks=[spy, FaultInjector("param", steps=[5]), rb], max_steps=8)
    trainer.fit(model)
    (incident,) = rollbacks(trainer)
    assert incident.step == 5
    assert incident.values["restored_from_step"] == 4
    assert incident.cause == "corrupt_state"
    assert "body.0.weight" in incident.where
    # The state entering step 6 is the snapshot of step 4: weights and optimizer moments, bit for bit.
    assert same(spy.params[6], spy.params[4])
    assert not same(spy.params[5], spy.params[4])
    assert all(torch.equal(a, b) for a, b in zip(spy.moments[6], spy.moments[4], strict=True))
    assert spy.restored == [StateRestored(4, RestoreSource.MEMORY)]
    assert all_finite(model)
    assert trainer.global_step == 8
    assert rb.rollbacks == 1


@pytest.mark.parametrize("target", ["grad", "loss"])
def test_one_bad_step_with_intact_state_is_dropped_not_rolled_back(tmp_path: Any, target: str) -> None:
    # Rolling back for one bad gradient would throw away good steps: dropping the update is the whole remedy.
    spy, model = StateSpy(), TinyModel()
    rb = AutoRollback(every_n_steps=2, quiet_steps=0)
    trainer = make_trainer(tmp_path, callbacks=[spy, FaultInjector(target, steps=[5]), rb], max_steps=8)
    trainer.fit(model)
    (incident,) = get_engine(trainer).sink.records
    assert (incident.step, incident.actions) == (5, ["skip"])
    assert rb.rollbacks == 0
    assert same(spy.params[6], spy.params[5])
    assert all_finite(model)


def test_recurring_bad_steps_escalate_to_a_rollback_without_gradnormmonitor(tmp_path: Any) -> None:
    # AutoRollback alone: a run of dropped updates is not dropped forever; it escalates, then stops on its budget.
    rb = AutoRollback(every_n_steps=2, quiet_steps=0, max_rollbacks=1)
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("grad", steps=range(3, 60)), rb], max_steps=60)
    with pytest.raises(RecoveryBudgetExhausted, match=r"rolled back 1 time.*rollback budget"):
        trainer.fit(TinyModel())
    # The escalation's rollback, then the one that ran out the budget: it restores before stopping, so the final
    # checkpoint holds a verified state.
    assert rb.rollbacks == 2


def test_gradscaler_overflow_is_left_to_the_scaler_and_its_lower_scale_is_kept(tmp_path: Any) -> None:
    # growth_interval=1: the scale doubles every good step, so the snapshot's scale is below the live one.
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1)
    scales: dict[int, float] = {}

    class ScaleSpy(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            scales[trainer.global_step] = scaler.get_scale()

    faults = [FaultInjector("grad", steps=[3]), FaultInjector("param", steps=[7])]
    rb = AutoRollback(every_n_steps=4, quiet_steps=0)
    trainer = make_trainer(
        tmp_path,
        "16-mixed",
        callbacks=[ScaleSpy(), *faults, rb],
        max_steps=9,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    trainer.fit(TinyModel())
    (incident,) = rollbacks(trainer)  # the fp16 overflow at step 3 was the scaler's to skip; only step 7 rolled back
    assert incident.step == 7
    assert incident.values["restored_from_step"] == 4
    assert scales[4] < scales[7] / 2  # the step-7 overflow halved the live scale, still above the snapshot's
    assert scales[8] == scales[4]  # min(current, snapshot)


def test_recurrence_restores_an_older_snapshot(tmp_path: Any) -> None:
    spy, model = StateSpy(), TinyModel()
    rb = AutoRollback(every_n_steps=2, num_snapshots=3, quiet_steps=0, recurrence_steps=5)
    faults = FaultInjector("param", steps=[5, 7])
    trainer = make_trainer(tmp_path, callbacks=[spy, faults, rb], max_steps=10)
    trainer.fit(model)
    assert [r.values["restored_from_step"] for r in rollbacks(trainer)] == [4, 2]
    assert [r.values["recurrence"] for r in rollbacks(trainer)] == [False, True]
    assert same(spy.params[8], spy.params[2])
    assert all_finite(model)


def test_budget_exhausted_stops_with_a_verified_final_checkpoint(tmp_path: Any) -> None:
    model = TinyModel()
    rb = AutoRollback(every_n_steps=2, quiet_steps=0, max_rollbacks=1, checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("param", steps=[3, 5]), rb], max_steps=20)
    with pytest.raises(
        RecoveryBudgetExhausted, match=r"global_step=5.*rollback budget.*max_rollbacks.*lower the learning rate"
    ) as err:
        trainer.fit(model)
    path = str(tmp_path / "ckpt" / "nanguard-final-step=5.ckpt")
    assert path in str(err.value)
    assert verify_checkpoint(path).ok
    assert all_finite(model)
    assert trainer.global_step == 6
    stop = get_engine(trainer).sink.records[-1]
    assert stop.action == "stop"
    assert stop.values["final_checkpoint"] == path


def test_fp16_true_eps_underflow_is_caught_and_rolled_back(tmp_path: Any) -> None:
    # AdamW eps=1e-8 is 0 in fp16: the first update divides by zero and the parameters go inf with finite grads.
    model = TinyModel(lr=0.01, eps=1e-8, foreach=False)
    rb = AutoRollback(every_n_steps=1, quiet_steps=0, max_rollbacks=2, checkpoint_dir=str(tmp_path))
    trainer = make_trainer(tmp_path, "16-true", callbacks=[rb], max_steps=10)
    with pytest.raises(RecoveryBudgetExhausted):
        trainer.fit(model)
    done = rollbacks(trainer)
    assert done[0].step == 1
    assert done[0].values["restored_from_step"] == 0
    assert {r.trigger for r in done} <= {"nonfinite_state", "nonfinite_loss_and_grads", "nonfinite_loss"}
    assert all_finite(model)


def test_skip_batches_after_rollback_drops_their_updates(tmp_path: Any) -> None:
    spy, rb = StateSpy(), AutoRollback(every_n_steps=2, quiet_steps=0, skip_batches=2)
    trainer = make_trainer(tmp_path, callbacks=[spy, FaultInjector("param", steps=[3]), rb], max_steps=8)
    trainer.fit(TinyModel())
    assert rb.skipped_batches == 2
    assert same(spy.params[4], spy.params[2])
    assert same(spy.params[6], spy.params[2])
    assert not same(spy.params[7], spy.params[6])


def test_tensorboard_keeps_the_history_and_marks_the_rollback(tmp_path: Any) -> None:
    rb = AutoRollback(every_n_steps=4, quiet_steps=0)
    trainer = make_trainer(
        tmp_path,
        logger=loggers(tmp_path),
        callbacks=[FaultInjector("param", steps=[7]), GradNormMonitor(), rb],
        max_steps=10,
    )
    trainer.fit(TinyModel())
    scalars = tb_scalars(os.path.join(str(tmp_path), "tb", "version_0"))
    # global_step is never rewound: nothing is purged, the history that explains the incident stays, and the
    # rollback is a marker at its own step.
    assert [s for s, _ in scalars["nanguard/rollbacks"]] == list(range(10))
    assert [v for s, v in scalars["nanguard/rollbacks"] if s >= 7] == [1.0, 1.0, 1.0]
    assert [s for s, _ in scalars["nanguard/incident/rollback"]] == [7]


def test_disk_source_restores_the_newest_verified_checkpoint_at_or_before_the_step(tmp_path: Any) -> None:
    good = _good_checkpoint(tmp_path, steps=2)
    ckpt_dir = tmp_path / "ckpts"
    torch.save({"not": "a checkpoint"}, str(ckpt_dir / "newer-unverified.ckpt"))  # no sidecar: must be ignored
    future = _good_checkpoint(tmp_path / "other", steps=9)  # verified, but from a step after the fault
    os.replace(future, ckpt_dir / "future.ckpt")
    os.replace(future + SIDECAR_SUFFIX, str(ckpt_dir / "future.ckpt") + SIDECAR_SUFFIX)
    saved = torch.load(good, weights_only=True)

    spy, model = StateSpy(), TinyModel(lr=0.01)
    rb = AutoRollback(source="disk", num_snapshots=0, checkpoint_dir=str(ckpt_dir))
    trainer = make_trainer(tmp_path, callbacks=[spy, FaultInjector("param", steps=[4]), rb], max_steps=6)
    trainer.fit(model)
    (incident,) = rollbacks(trainer)
    assert incident.values["rollback_source"] == "disk"
    assert incident.values["checkpoint"] == good
    assert incident.values["restored_from_step"] == 2
    assert all(torch.equal(spy.params[5][k], saved["state_dict"][k]) for k in spy.params[5])
    assert spy.restored == [StateRestored(2, RestoreSource.DISK)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.01  # the live hyperparameters win over the file's


def test_state_round_trips_through_a_weights_only_checkpoint(tmp_path: Any) -> None:
    rb = AutoRollback(every_n_steps=2, quiet_steps=0, skip_batches=1)
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("param", steps=[3]), rb], max_steps=8)
    trainer.fit(TinyModel())
    path = str(tmp_path / "state.ckpt")
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"][rb.state_key]
    assert not any(isinstance(v, torch.Tensor) for v in state.values())  # counters only, no snapshot
    fresh = AutoRollback(every_n_steps=2, quiet_steps=0, skip_batches=1)
    fresh.load_state_dict(state)
    assert fresh.rollbacks == 1
    assert fresh.skipped_batches == 1
    assert fresh.state_dict() == rb.state_dict()
    fresh.load_state_dict({})  # tolerant of older/empty state
    assert fresh.rollbacks == 0
    resumed = AutoRollback(every_n_steps=2, quiet_steps=0, skip_batches=1)
    make_trainer(tmp_path, callbacks=[resumed], max_steps=10).fit(TinyModel(), ckpt_path=path)  # weights_only load
    assert resumed.rollbacks == 1
    assert resumed.skipped_batches == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, r"AutoRollback\(every_n_steps=0\): must be an int >= 1"),
        ({"num_snapshots": 0}, r"AutoRollback\(num_snapshots=0, source='memory'\): .* num_snapshots >= 1"),
        ({"max_rollbacks": 0}, r"AutoRollback\(max_rollbacks=0\): must be an int >= 1"),
        ({"rollback_window": 1.5}, r"AutoRollback\(rollback_window=1.5\): must be an int >= 1"),
        ({"skip_batches": -1}, r"AutoRollback\(skip_batches=-1\): must be an int >= 0"),
        ({"source": "cloud"}, r"AutoRollback\(source='cloud'\): must be one of \['disk', 'memory'\]"),
        ({"checkpoint_dir": 3}, r"AutoRollback\(checkpoint_dir=3\): must be a path \(str or os.PathLike\) or None"),
        (
            {"source": "disk", "num_snapshots": 0, "checkpoint_dir": "/no/such/dir"},
            r"AutoRollback\(source='disk', checkpoint_dir='/no/such/dir'\): must be an existing directory",
        ),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(NanGuardConfigError, match=message):
        AutoRollback(**kwargs)


def _good_checkpoint(tmp_path: Any, steps: int = 6) -> str:
    trainer = make_trainer(tmp_path, max_steps=steps)
    trainer.fit(TinyModel())
    path = str(tmp_path / "ckpts" / "good.ckpt")
    trainer.save_checkpoint(path)
    write_sidecar(path)
    return path


def test_memory_falls_back_to_disk_when_no_older_snapshot_exists(tmp_path: Any) -> None:
    good = _good_checkpoint(tmp_path)
    rb = AutoRollback(
        every_n_steps=2, num_snapshots=1, quiet_steps=0, recurrence_steps=5, checkpoint_dir=os.path.dirname(good)
    )
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("param", steps=[5, 7]), rb], max_steps=9)
    trainer.fit(TinyModel())
    # One slot: the recurrence at 7 wants something older than step 4, which only the checkpoint (step 6) is.
    assert [(r.values["rollback_source"], r.values["restored_from_step"]) for r in rollbacks(trainer)] == [
        ("memory", 4),
        ("disk", 6),
    ]


def test_disk_source_without_a_checkpoint_dir_is_refused(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AutoRollback(source="disk")], max_steps=2)
    with pytest.raises(UnsupportedSetupError, match=r"source='disk'\) needs a checkpoint directory"):
        trainer.fit(TinyModel())


def test_same_run_whatever_the_callback_order(tmp_path: Any) -> None:
    finals = []
    for order in (0, 1):
        pl.seed_everything(7)
        model = TinyModel()
        pair = [GradNormMonitor(), AutoRollback(every_n_steps=2, quiet_steps=0)]
        trainer = make_trainer(
            tmp_path / str(order), callbacks=[FaultInjector("param", steps=[3]), *pair[:: 1 - 2 * order]], max_steps=6
        )
        trainer.fit(model)
        assert [r.values["restored_from_step"] for r in rollbacks(trainer)] == [2]
        finals.append(params_of(model))
    assert same(finals[0], finals[1])


def test_gradient_accumulation_rolls_back_the_whole_window(tmp_path: Any) -> None:
    spy, rb = StateSpy(), AutoRollback(every_n_steps=2, quiet_steps=0)
    faults = FaultInjector("param", steps=[3])  # at the first micro-batch of step 3
    trainer = make_trainer(tmp_path, callbacks=[spy, faults, rb], max_steps=5, accumulate_grad_batches=2)
    trainer.fit(TinyModel())
    (incident,) = rollbacks(trainer)
    assert incident.step == 3
    assert incident.values["restored_from_step"] == 2
    assert same(spy.params[4], spy.params[2])
