"""The callbacks together: one health reading per step, the same run whatever their order, one host read per step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_nanguard as ng
from lightning_nanguard.context import get_context
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer, params_of


def _suite() -> list[pl.Callback]:
    return [ng.GradNormMonitor(), ng.AutoRollback(every_n_steps=2, quiet_steps=0), ng.OptimizerBackoff()]


def _run(
    tmp_path: Any, callbacks: list[pl.Callback]
) -> tuple[dict[str, torch.Tensor], list[tuple[int, str, str]], float]:
    pl.seed_everything(11, verbose=False)
    model = TinyModel()
    trainer = make_trainer(tmp_path, max_steps=12, callbacks=callbacks)
    trainer.fit(model)
    incidents = sorted((i.step, i.action, i.source) for i in get_context(trainer).incidents.records)
    return params_of(model), incidents, trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_order_of_callbacks_does_not_change_the_run(tmp_path: Any, precision: str) -> None:
    inject = [FaultInjector("param", steps=[5]), FaultInjector("loss", steps=[9])]
    forward = _run(tmp_path / "a", [*inject, *_suite()])
    backward = _run(tmp_path / "b", [*_suite()[::-1], *inject[::-1]])
    assert forward[1] == backward[1]
    assert {a for _, a, _ in forward[1]} >= {"rollback", "backoff"}
    assert forward[2] == backward[2] == pytest.approx(0.05 * 0.5**2)
    assert all(torch.equal(forward[0][k], backward[0][k]) for k in forward[0])


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.norm_passes = 0
        self.host_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if name.startswith("_foreach_norm"):
            self.norm_passes += 1
        elif name.startswith("_local_scalar_dense"):
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


class _CountPerStep(pl.Callback):
    """Counts gradient-norm passes and host reads from batch start to batch end (optimizer step included)."""

    def __init__(self) -> None:
        self.per_step: list[tuple[int, int]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._mode = _HostReads()
        self._mode.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self._mode.__exit__(None, None, None)
        self.per_step.append((self._mode.norm_passes, self._mode.host_reads))


def _counts(tmp_path: Any, callbacks: list[pl.Callback]) -> list[tuple[int, int]]:
    counter = _CountPerStep()
    # Logging every 50 steps and snapshots every 100: these 6 steps are plain healthy steps.
    trainer = make_trainer(tmp_path, max_steps=6, log_every_n_steps=50, callbacks=[*callbacks, counter])
    trainer.fit(TinyModel())
    return counter.per_step[1:]


def test_one_health_pass_and_one_host_read_per_healthy_step(tmp_path: Any) -> None:
    plain = _counts(tmp_path / "plain", [])
    suite = [
        ng.GradNormMonitor(),
        ng.AutoRollback(every_n_steps=100),
        ng.OptimizerBackoff(),
        ng.CheckpointGuard(),
    ]
    guarded = _counts(tmp_path / "guarded", suite)
    for (p_norms, p_reads), (g_norms, g_reads) in zip(plain, guarded, strict=True):
        assert g_norms - p_norms == 1, "the step's gradients were read more than once"
        assert g_reads - p_reads == 1, "more than one host read per healthy step"


def test_suite_recovers_a_run_that_dies_without_it(tmp_path: Any) -> None:
    def fit(callbacks: list[pl.Callback]) -> TinyModel:
        model = TinyModel()
        make_trainer(tmp_path, max_steps=12, callbacks=[FaultInjector("param", steps=[6]), *callbacks]).fit(model)
        return model

    assert not all_finite(fit([]))
    assert all_finite(fit(_suite()))


class _StepThreeDetector(pl.Callback):
    """Registers an on-device detector that fires at global_step 3 and records the reduced verdicts."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.trainer = trainer
        get_context(trainer).add_detector("step_three", lambda grads, loss: torch.tensor(trainer.global_step == 3))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.seen[trainer.global_step] = (
            get_context(trainer).step_health(trainer, pl_module, optimizer).flags["step_three"]
        )


def test_registered_detectors_share_the_single_host_read(tmp_path: Any) -> None:
    detector = _StepThreeDetector()
    plain = _counts(tmp_path / "plain", [])
    guarded = _counts(tmp_path / "guarded", [ng.GradNormMonitor(), detector])
    assert detector.seen == {0: False, 1: False, 2: False, 3: True, 4: False, 5: False}
    assert [g[1] - p[1] for p, g in zip(plain, guarded, strict=True)] == [1] * len(plain)
