"""GradNormMonitor's optional spike detection on real fits, with a deterministic 1000x loss spike."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard import AutoRollback, GradNormMonitor, NanGuardConfigError
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.callbacks.test_grad_norm_monitor import ParamsAtBatchStart, _same
from tests.helpers import TinyModel, all_finite, make_trainer, params_of

SPIKE_AT = 30


def _fit(
    tmp_path: Any, callbacks: list[pl.Callback], steps: int = 36, spike: bool = True
) -> tuple[pl.Trainer, TinyModel]:
    pl.seed_everything(5, verbose=False)
    model = TinyModel(lr=0.01)
    inject = [FaultInjector("loss", steps=[SPIKE_AT], value=1e3)] if spike else []
    trainer = make_trainer(tmp_path, max_steps=steps, log_every_n_steps=50, callbacks=[*inject, *callbacks])
    trainer.fit(model)
    return trainer, model


def _incidents(trainer: pl.Trainer) -> list[tuple[int, str, str]]:
    # Which signal crossed the threshold depends on the data (this regression's per-batch loss varies over orders of
    # magnitude, so its loss z-score stays lower than the gradient norm's): assert that a spike was seen.
    return [
        (i.step, i.action, "spike" if i.trigger.endswith("spike") else i.trigger)
        for i in get_engine(trainer).sink.records
    ]


def test_spike_is_skipped_at_its_step_and_nowhere_else(tmp_path: Any) -> None:
    spy = ParamsAtBatchStart()
    monitor = GradNormMonitor(spike_zscore=6.0, spike_warmup=10, on_spike="skip")
    trainer, _ = _fit(tmp_path, [monitor, spy])
    assert _incidents(trainer) == [(SPIKE_AT, "skip", "spike")]
    record = get_engine(trainer).sink.records[0]
    assert max(record.values["loss_zscore"], record.values["grad_norm_zscore"]) > 6.0
    assert _same(spy.at[SPIKE_AT], spy.at[SPIKE_AT + 1])
    assert monitor.skipped_steps == 1


def test_without_detection_the_spike_lands(tmp_path: Any) -> None:
    spy = ParamsAtBatchStart()
    trainer, _ = _fit(tmp_path, [GradNormMonitor(), spy])
    assert _incidents(trainer) == []
    assert not _same(spy.at[SPIKE_AT], spy.at[SPIKE_AT + 1])


def test_warn_mode_records_warns_and_lets_the_update_through(tmp_path: Any) -> None:
    spy = ParamsAtBatchStart()
    with pytest.warns(UserWarning, match=r"spike at global_step=30.*on_spike='warn'"):
        trainer, _ = _fit(tmp_path, [GradNormMonitor(spike_zscore=6.0, spike_warmup=10), spy])
    assert _incidents(trainer) == [(SPIKE_AT, "warn", "spike")]
    assert not _same(spy.at[SPIKE_AT], spy.at[SPIKE_AT + 1])


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "rollback-first"])
def test_rollback_mode_hands_the_spike_to_autorollback(tmp_path: Any, monitor_first: bool) -> None:
    spy = ParamsAtBatchStart()
    monitor = GradNormMonitor(spike_zscore=6.0, spike_warmup=10, on_spike="rollback")
    rollback = AutoRollback(every_n_steps=4, quiet_steps=0)
    trainer, model = _fit(tmp_path, [monitor, rollback, spy] if monitor_first else [rollback, monitor, spy])
    (incident,) = get_engine(trainer).sink.records  # one event, one incident, both actions
    assert (incident.step, incident.actions) == (SPIKE_AT, ["skip", "rollback"])
    restored = incident.values["restored_from_step"]
    assert restored == 28  # the newest snapshot before the spike (every 4 steps)
    assert _same(spy.at[restored], spy.at[SPIKE_AT + 1])
    assert all_finite(model)


def test_rollback_mode_without_autorollback_warns_at_setup(tmp_path: Any) -> None:
    with pytest.warns(UserWarning, match="AutoRollback, which is not installed"):
        _fit(tmp_path, [GradNormMonitor(spike_zscore=6.0, on_spike="rollback")], steps=2, spike=False)


def test_healthy_run_is_bit_identical_with_detection_on(tmp_path: Any) -> None:
    _, plain = _fit(tmp_path / "a", [], spike=False)
    trainer, watched = _fit(tmp_path / "b", [GradNormMonitor(spike_zscore=4.0, spike_warmup=5)], spike=False)
    assert _incidents(trainer) == []
    a, b = params_of(plain), params_of(watched)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_spike_statistics_survive_a_weights_only_checkpoint(tmp_path: Any) -> None:
    monitor = GradNormMonitor(spike_zscore=6.0, spike_warmup=4)
    trainer, _ = _fit(tmp_path, [monitor], steps=8, spike=False)
    path = os.path.join(tmp_path, "s.ckpt")
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"][monitor.state_key]
    assert state["spike"]["grad"]["count"] == 8.0
    resumed = GradNormMonitor(spike_zscore=6.0, spike_warmup=4)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["spike"] == state["spike"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"spike_zscore": 0}, r"GradNormMonitor\(spike_zscore=0\): must be a number in \(0.0, inf\) or None"),
        ({"spike_warmup": 0}, r"GradNormMonitor\(spike_warmup=0\): must be an int >= 1"),
        (
            {"on_spike": "stop"},
            r"GradNormMonitor\(on_spike='stop'\): must be one of \['probe', 'rollback', 'skip', 'warn'\]",
        ),
    ],
)
def test_bad_spike_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(NanGuardConfigError, match=match):
        GradNormMonitor(**kwargs)
