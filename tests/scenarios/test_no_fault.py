"""Do no harm: healthy runs with alarming but benign dynamics, with and without the preset.

Each task (``_benign.py``: a domain switch that lifts the loss ~100x and recovers, rare hard batches, heavy-tailed
valid inputs with 20-100x gradient-norm spikes, a loss falling by orders of magnitude, LR restarts, additive ``-inf``
attention masks, a warmup from a learning rate of 0) is fit twice from the same seed: unguarded, and with
``default_callbacks()``, whose GradNormMonitor probes every spike. The preset must end with the same loss (within 1%)
and the same Python-side state (each module keeps, beside its weights, a list of step losses, a counter, an EMA in
plain tensors and one in an ``AveragedModel``, and draws from a generator of its own: ``_benign.SideState``), and
intervene nowhere: no incident, no rollback, no dropped update, no quarantine, no LR or eps change, no module
promoted (by an overflow or by the headroom forecast). Under ``16-mixed`` too (the loss-scale collapse rule), and with spikes dropped instead of probed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_nanguard import (
    AutoRollback,
    FP32Evaluation,
    GradNormMonitor,
    OptimizerBackoff,
    PrecisionHeadroom,
    default_callbacks,
)
from lightning_nanguard.engine import get_engine
from tests.scenarios._benign import TASKS, Fit, fit_task

TOLERANCE = 0.01  # the preset's final loss against the unguarded run's

pytestmark = pytest.mark.timeout(120)


class _Unguarded(dict[tuple[str, str], Fit]):
    """The unguarded run of ``(task, precision)``, fit on first use."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, key: tuple[str, str]) -> Fit:
        self[key] = fit = fit_task(key[0], [], self.root, precision=key[1])
        return fit


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory: pytest.TempPathFactory) -> _Unguarded:
    return _Unguarded(str(tmp_path_factory.mktemp("unguarded")))


def _groups(fit: Fit) -> list[tuple[float, Any]]:
    return [(g["lr"], g.get("eps")) for opt in fit.trainer.optimizers for g in opt.param_groups]


def _find(callbacks: list[Callback], kind: type[Callback]) -> Any:
    return next(c for c in callbacks if isinstance(c, kind))


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


def _assert_untouched(fit: Fit, callbacks: list[Callback], reference: Fit, *, state: bool = True) -> None:
    engine = get_engine(fit.trainer)
    records = [(i.step, i.trigger, i.cause, list(i.actions)) for i in engine.sink.records]
    assert records == [], records
    assert engine.skipped_steps == 0
    rollback, backoff = _find(callbacks, AutoRollback), _find(callbacks, OptimizerBackoff)
    monitor, fp32 = _find(callbacks, GradNormMonitor), _find(callbacks, FP32Evaluation)
    assert (rollback.rollbacks, rollback.skipped_batches) == (0, 0)
    assert (backoff.lr_scale, backoff.eps_scale) == (1.0, 1.0)
    assert (monitor.skipped_steps, monitor.quarantined_samples, fp32.promoted) == (0, [], [])
    assert _find(callbacks, PrecisionHeadroom).promoted == []
    assert _groups(fit) == _groups(reference)  # the schedule's LR and the eps as configured, to the last step
    assert fit.trainer.global_step == reference.trainer.global_step
    ratio = fit.final_loss / reference.final_loss
    assert abs(ratio - 1.0) <= TOLERANCE, (fit.final_loss, reference.final_loss)
    if state:  # what the training_step keeps beside the weights: the step losses, a counter, two EMAs, a generator
        _assert_same(fit.module.side_state(), reference.module.side_state())


# Gradient spikes of 20-100x overflow float16 at the GradScaler's scale: unguarded, the scaler's routine skips make a
# different run, so that task is compared with float32's (test_heavy_tailed_spikes_under_16_mixed_drop_no_update).
_FLOAT32_ONLY = {"heavy-tailed"}


@pytest.mark.parametrize(
    ("task", "precision"),
    [(t, p) for t in TASKS for p in ("32-true", "16-mixed") if p == "32-true" or t not in _FLOAT32_ONLY],
)
def test_the_preset_leaves_a_healthy_run_alone(unguarded: _Unguarded, tmp_path: Any, task: str, precision: str) -> None:
    reference = unguarded[task, precision]
    assert torch.isfinite(torch.tensor(reference.final_loss))
    callbacks = default_callbacks()
    fit = fit_task(task, callbacks, str(tmp_path), precision=precision)
    _assert_untouched(fit, callbacks, reference)
    # Do no harm, to the last bit: under 16-mixed too (the first step's trial, the per-op samples, the scale cut)
    final, expected = fit.trainer.lightning_module.state_dict(), reference.trainer.lightning_module.state_dict()
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in final), [
        k for k in final if not torch.equal(final[k], expected[k])
    ]


def test_heavy_tailed_spikes_under_16_mixed_drop_no_update(unguarded: _Unguarded, tmp_path: Any) -> None:
    # Unguarded, the GradScaler drops 5 of its spikes' updates in 160 steps (and ends lower than float32, 1.41 against
    # 2.55: the spikes it dropped were the data's). The preset lowers the scale ahead of them: no update dropped, no
    # incident, and the run ends where float32's does.
    callbacks = default_callbacks()
    fit = fit_task("heavy-tailed", callbacks, str(tmp_path), precision="16-mixed")
    _assert_untouched(fit, callbacks, unguarded["heavy-tailed", "32-true"], state=False)  # another precision


@pytest.mark.parametrize("task", list(TASKS))
def test_spike_detection_leaves_a_healthy_run_alone(unguarded: _Unguarded, tmp_path: Any, task: str) -> None:
    # The preset probes spikes; dropping a spike's update instead, as the docstring suggests, is harmless too.
    callbacks = default_callbacks(GradNormMonitor={"spike_zscore": 6.0, "spike_warmup": 50, "on_spike": "skip"})
    _assert_untouched(fit_task(task, callbacks, str(tmp_path)), callbacks, unguarded[task, "32-true"])


@pytest.mark.parametrize(
    ("task", "zscore"),
    [("hard-batches", 3.0), ("heavy-tailed", 3.0), ("domain-switch", 2.5), ("domain-switch-sgd", 2.5)],
)
def test_spikes_whose_probe_held_are_left_alone(unguarded: _Unguarded, tmp_path: Any, task: str, zscore: float) -> None:
    # The spikes are real (a hard batch, a heavy-tailed row, the first steps of a new domain: a more sensitive
    # detector catches the switch) and each is probed: the probe batch did not do as badly as the spiking batch, so
    # nothing at all is done.
    callbacks = default_callbacks(GradNormMonitor={"spike_zscore": zscore})
    fit = fit_task(task, callbacks, str(tmp_path))
    _assert_untouched(fit, callbacks, unguarded[task, "32-true"])
    probe = _find(callbacks, AutoRollback).probe
    snapshots = len(range(0, fit.trainer.global_step, 50))
    assert probe.scorings > snapshots
    assert probe.verdict is not None
    assert not probe.verdict.rose
