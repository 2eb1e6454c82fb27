"""A legitimate jump is not a divergence (issue 24): a new data domain lifts the loss and the gradient norm far above
the last sound snapshot's and they fall by themselves; the preset must neither roll back nor lower the LR. The same
switch onto inputs 4x larger puts the learning rate past the stability edge: that growth, which does not turn, is
still rolled back, and the LR lowered, before anything is non-finite.

Both runs are the linear model of ``tests/scenarios/_benign.py`` under SGD with momentum, switched at step 97; the
preset's step-100 snapshot reads the new domain's fourth step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from lightning_nanguard import AutoRollback, OptimizerBackoff, default_callbacks
from lightning_nanguard.engine import get_engine
from tests.scenarios._benign import BATCH, EVERY, SWITCH, Task, fit_task, linear_domain_switch

pytestmark = pytest.mark.timeout(120)


def _task(input_scale: float) -> Task:
    return Task("switch", lambda seed: linear_domain_switch(seed, input_scale), 200, slice(SWITCH * BATCH, None))


def _preset(input_scale: float, root: Any, **overrides: Any) -> tuple[Any, AutoRollback, OptimizerBackoff, list[Any]]:
    callbacks = default_callbacks(**overrides)
    fit = fit_task(_task(input_scale), callbacks, str(root))
    rollback = next(c for c in callbacks if isinstance(c, AutoRollback))
    backoff = next(c for c in callbacks if isinstance(c, OptimizerBackoff))
    return fit, rollback, backoff, list(get_engine(fit.trainer).sink.records)


def test_a_new_domain_is_not_rolled_back_nor_the_learning_rate_lowered(tmp_path: Any) -> None:
    unguarded = fit_task(_task(1.0), [], str(tmp_path / "unguarded"))
    losses = unguarded.module.losses
    assert losses[2 * EVERY] > 100 * losses[EVERY]  # the step-100 snapshot reads far above the step-50 one
    assert max(losses[-10:]) < 10 * losses[EVERY]  # and the run recovers by itself
    fit, rollback, backoff, records = _preset(1.0, tmp_path / "preset")
    assert records == []
    assert (rollback.rollbacks, backoff.lr_scale) == (0, 1.0)
    assert rollback.book.judge.unsound == set()  # the jump turned: its snapshot is sound after all
    assert fit.final_loss == pytest.approx(unguarded.final_loss, rel=0.01)


def test_a_divergence_after_the_switch_is_caught_by_the_probe_before_anything_is_non_finite(tmp_path: Any) -> None:
    # The preset probes spikes: the switch's first spikes re-score the probe batch (old-domain samples), and as the
    # weights blow up it does as badly as the new batches: rolled back to the step-50 snapshot before the step-100
    # one is even taken.
    fit, _, backoff, records = _preset(4.0, tmp_path / "preset")
    first = records[0]
    assert (first.trigger, first.cause, list(first.actions)) == (
        "probe_rose",
        "weights_diverging",
        ["rollback", "backoff"],
    )
    assert SWITCH < first.step <= SWITCH + 3
    assert first.values["restored_from_step"] == EVERY
    assert all(math.isfinite(v) for v in fit.module.losses)
    assert backoff.lr_scale < 1.0
    assert fit.final_loss < 10.0


def test_a_divergence_after_the_switch_is_rolled_back_before_anything_is_non_finite(tmp_path: Any) -> None:
    # Without the probe (spikes not tested), the snapshot judged by its own step's reading catches it.
    unguarded = fit_task(_task(4.0), [], str(tmp_path / "unguarded"))
    assert unguarded.final_loss > 1e6  # the loss grows by orders of magnitude and never turns
    fit, _, backoff, records = _preset(
        4.0, tmp_path / "preset", GradNormMonitor={"spike_zscore": None, "on_spike": "warn"}
    )
    first = records[0]
    assert (first.trigger, first.cause, list(first.actions)) == (
        "diverging",
        "gradient_explosion",
        ["rollback", "backoff"],
    )
    assert SWITCH < first.step <= SWITCH + 8  # a few steps after the switch, once the growth showed
    assert first.values["restored_from_step"] == EVERY  # past the step-100 snapshot, taken mid-divergence
    assert first.where.startswith(f"the snapshot of step {2 * EVERY}: ")
    assert all(math.isfinite(v) for v in fit.module.losses)
    assert backoff.lr_scale < 1.0
    assert fit.final_loss < 10.0
