"""A resume keeps every callback's saved state whatever arguments changed between the runs (issue 30).

The state was saved under a key built from some arguments (GradNormMonitor's ``on_nonfinite`` and ``layer_depth``,
AutoRollback's ``every_n_steps`` and ``source``, ...): resuming with another ``layer_depth`` (a logging knob) loaded
none of GradNormMonitor's state, and the quarantined record came back as a fresh incident every epoch. The key is now
the class name (``callbacks/_state.py``); a checkpoint that saved the state under an older key is still read; state
a callback cannot take is reported, never dropped in silence.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor, NanGuardWarning, default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.preset import CALLBACKS
from tests.helpers import TinyModel, make_trainer
from tests.regressions.test_quarantine_data_kinds import Recorder, indexed_data

# Per callback: arguments changed at the resume (every one that was in its key before, and some more), and a value
# planted in its saved state that the resumed callback must hold (key in its state_dict, value).
CHANGED: dict[str, tuple[dict[str, Any], str, Any]] = {
    "GradNormMonitor": ({"layer_depth": 2, "on_nonfinite": "stop", "log_every_n_steps": 3}, "skipped_steps", 5),
    "AutoRollback": ({"every_n_steps": 3, "quiet_steps": 2, "max_rollbacks": 9}, "rollbacks", 3),
    "OptimizerBackoff": ({"lr_factor": 0.25, "triggers": "rollback", "recover_with_schedule": False}, "backoffs", 2),
    "LossScaleWatchdog": ({"min_scale": 4.0, "on_collapse": "warn", "window": 50}, "floor_hits", 7),
    "CheckpointGuard": ({"tag_last_good": False}, "refused_saves", 2),
    "FP32Evaluation": ({"promote_after": 5}, "fp32_reruns", 4),
    "PrecisionHeadroom": ({"every_n_steps": 10, "margin_bits": 2.0, "demote_after": None}, "promotions", 3),
}
# The keys the state was saved under before it was the class name (what a checkpoint of then holds).
OLDER_KEYS = {
    "GradNormMonitor": "GradNormMonitor{'on_nonfinite': 'skip', 'layer_depth': 1}",
    "AutoRollback": "AutoRollback{'every_n_steps': 50, 'source': 'memory'}",
    "OptimizerBackoff": "OptimizerBackoff{'lr_factor': 0.5, 'triggers': 'rollback,skip,loss_scale_collapse'}",
    "LossScaleWatchdog": "LossScaleWatchdog{'min_scale': 1.0, 'on_collapse': 'auto'}",
    "FP32Evaluation": "FP32Evaluation{'mode': 'on_nonfinite'}",
}


def test_every_state_key_is_the_class_name_whatever_the_arguments() -> None:
    assert set(CHANGED) == {cls.__name__ for cls in CALLBACKS}  # the table covers every callback
    for cls in CALLBACKS:
        changed, _, _ = CHANGED[cls.__name__]
        assert cls().state_key == cls(**changed).state_key == cls.__name__


def _planted_checkpoint(tmp_path: Any, *, older_keys: bool) -> str:
    """A preset run's checkpoint whose states hold CHANGED's values (under OLDER_KEYS if asked)."""
    trainer = make_trainer(tmp_path, max_steps=8, callbacks=default_callbacks())
    trainer.fit(TinyModel())  # one epoch: the resume starts at an epoch boundary
    path = os.path.join(tmp_path, "run.ckpt")
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    states = ckpt["callbacks"]
    for name, (_, key, value) in CHANGED.items():
        states[name][key] = value
        if older_keys and name in OLDER_KEYS:
            states[OLDER_KEYS[name]] = states.pop(name)
    planted = os.path.join(tmp_path, "planted.ckpt")  # no sidecar: the preset checks it on its own merits
    torch.save(ckpt, planted)
    return planted


@pytest.mark.parametrize("older_keys", [False, True], ids=["keys_of_now", "older_keys"])
def test_a_resume_with_other_arguments_loads_every_callbacks_state(tmp_path: Any, older_keys: bool) -> None:
    path = _planted_checkpoint(tmp_path, older_keys=older_keys)
    callbacks = default_callbacks(**{name: changed for name, (changed, _, _) in CHANGED.items()})
    trainer = make_trainer(tmp_path, max_steps=10, callbacks=callbacks)
    if older_keys:  # Lightning's own word on keys it does not know; nanguard's callbacks read them all the same
        with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):
            trainer.fit(TinyModel(), ckpt_path=path)
    else:
        trainer.fit(TinyModel(), ckpt_path=path)
    for callback in callbacks:
        _, key, value = CHANGED[type(callback).__name__]
        assert callback.state_dict()[key] == value, type(callback).__name__


class BadRecord(Recorder):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*indexed_data(32, bad=[13])), batch_size=8)


def _fit(tmp_path: Any, epochs: int, callbacks: list[pl.Callback], ckpt_path: str | None = None) -> pl.Trainer:
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=epochs, callbacks=callbacks)
    trainer.fit(BadRecord(), ckpt_path=ckpt_path)
    return trainer


def test_the_quarantine_survives_a_resume_with_another_layer_depth(tmp_path: Any) -> None:
    first = _fit(tmp_path, 2, default_callbacks())
    assert [r.cause for r in get_engine(first).sink.records] == ["input_data"]
    path = os.path.join(tmp_path, "first.ckpt")
    first.save_checkpoint(path)
    monitor = GradNormMonitor(layer_depth=2)
    resumed = _fit(tmp_path, 4, [*default_callbacks(GradNormMonitor=False), monitor], ckpt_path=path)
    assert get_engine(resumed).sink.records == []  # the record stays quarantined: no new incident
    assert monitor.quarantined_samples == [13]


def test_a_quarantine_the_resumed_monitor_cannot_hold_is_reported(tmp_path: Any) -> None:
    first = _fit(tmp_path, 1, [GradNormMonitor()])
    path = os.path.join(tmp_path, "first.ckpt")
    first.save_checkpoint(path)
    with pytest.warns(
        NanGuardWarning,
        match=r"GradNormMonitor: the checkpoint's quarantine \(1 kept out of training.*quarantine=False",
    ):
        _fit(tmp_path, 2, [GradNormMonitor(quarantine=False)], ckpt_path=path)


def test_two_older_states_of_one_kind_are_reported_not_guessed(tmp_path: Any) -> None:
    first = _fit(tmp_path, 1, [GradNormMonitor()])
    path = os.path.join(tmp_path, "first.ckpt")
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    state = ckpt["callbacks"].pop("GradNormMonitor")
    ckpt["callbacks"][OLDER_KEYS["GradNormMonitor"]] = state
    ckpt["callbacks"]["GradNormMonitor{'on_nonfinite': 'warn', 'layer_depth': 1}"] = state
    torch.save(ckpt, path)
    monitor = GradNormMonitor()
    with (
        pytest.warns(UserWarning, match="callbacks used to create the checkpoint"),
        pytest.warns(NanGuardWarning, match="holds 2 states of a GradNormMonitor .* none of them is loaded"),
    ):
        _fit(tmp_path, 2, [monitor], ckpt_path=path)
