"""The device paths on CUDA: every optimizer path saves a run from a real bad record, a damaged state rolls back to
exactly the snapshot (copied on the side stream), and healthy steps add no CUDA synchronization where the verdict
stays on the device."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard import default_callbacks
from lightning_nanguard.testing import FaultInjector
from tests.gpu._helpers import BadRecordModel, Incidents, StateProbe, gpu, gpu_trainer, needs_cuda
from tests.helpers import TinyModel

pytestmark = gpu

PATHS = [
    ("32-true", {"fused": True}),  # the fused optimizer skips on the device from found_inf
    ("bf16-mixed", {"fused": True}),
    ("16-mixed", {"foreach": True}),  # the GradScaler's found_inf, nanguard's verdict ORed into it
    ("bf16-mixed", {"foreach": True}),  # the host path: one read of the reduced step vector
]
IDS = ["fused-32", "fused-bf16", "gradscaler-16", "foreach-bf16"]


@pytest.mark.parametrize(("precision", "opt_kw"), PATHS, ids=IDS)
def test_a_bad_record_is_skipped_and_quarantined_on_every_optimizer_path(
    tmp_path: Any, precision: str, opt_kw: dict[str, Any]
) -> None:
    probe = Incidents()
    trainer = gpu_trainer(tmp_path, precision, callbacks=[*default_callbacks(), probe])
    trainer.fit(BadRecordModel(**opt_kw))
    assert probe.finite
    # One incident, at the bad batch of the first epoch; in the second epoch the record is quarantined (replaced).
    assert [(step, cause) for step, _, cause in probe.seen] == [(2, "input_data")]
    assert "rollback" not in probe.seen[0][1]


@pytest.mark.parametrize(("precision", "opt_kw"), PATHS[1:3], ids=IDS[1:3])
def test_a_damaged_state_rolls_back_to_exactly_the_snapshot(
    tmp_path: Any, precision: str, opt_kw: dict[str, Any]
) -> None:
    # Snapshots every 2 steps; the weights are damaged at the start of step 5: the step-4 snapshot is restored.
    state = StateProbe(taken=4, restored=5)
    probe = Incidents()
    callbacks = [
        FaultInjector("param", steps=[5]),
        *default_callbacks(AutoRollback={"every_n_steps": 2, "quiet_steps": 0}),
        state,
        probe,
    ]
    gpu_trainer(tmp_path, precision, callbacks=callbacks, max_steps=8).fit(TinyModel(**opt_kw))
    assert [(step, "rollback" in actions) for step, actions, _ in probe.seen] == [(5, True)]
    assert state.exact is True
    assert probe.finite


class SyncsPerStep(pl.Callback):
    """CUDA synchronizations per training step, from ``torch.cuda.set_sync_debug_mode("warn")``'s warnings."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self.caught = caught
        self.marks: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(sum("synchronizing" in str(w.message) for w in self.caught))

    @property
    def per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def _syncs(tmp_path: Any, callbacks: list[pl.Callback], precision: str, opt_kw: dict[str, Any]) -> list[int]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counter = SyncsPerStep(caught)
        # No logging step and no snapshot step among the counted ones: plain healthy steps.
        trainer = gpu_trainer(tmp_path, precision, max_steps=8, log_every_n_steps=50, callbacks=[*callbacks, counter])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.fit(TinyModel(**opt_kw))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return counter.per_step[1:]  # the first step creates the optimizer state


@needs_cuda
@pytest.mark.parametrize(
    ("precision", "opt_kw", "extra"), [(*p, e) for p, e in zip(PATHS, [0, 0, 0, 1], strict=True)], ids=IDS
)
def test_cuda_syncs_added_per_healthy_step(tmp_path: Any, precision: str, opt_kw: dict[str, Any], extra: int) -> None:
    plain = _syncs(tmp_path / "plain", [], precision, opt_kw)
    guarded = _syncs(tmp_path / "guarded", default_callbacks(AutoRollback={"every_n_steps": 100}), precision, opt_kw)
    assert [g - p for p, g in zip(plain, guarded, strict=True)] == [extra] * len(plain), (plain, guarded)
