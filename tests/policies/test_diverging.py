"""A snapshot taken mid-divergence is an event of its own (``Signal.DIVERGING``): the trend that decides it, its
diagnosis, its remedy, and ``AutoRollback.diverging()`` reporting it once, in a real fit, where a jump that holds or
falls is not reported."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from lightning_nanguard import AutoRollback, OptimizerBackoff
from lightning_nanguard.contract import Action, Cause, Divergence, EvidenceKind, Signal, StepHealth
from lightning_nanguard.engine import get_engine
from lightning_nanguard.policies.diagnosis import classify, needs_replay
from lightning_nanguard.policies.findings import Findings
from lightning_nanguard.policies.remedy import Installed, RemedyFacts, plan_remedy
from lightning_nanguard.policies.snapshot_health import (
    DIVERGED_FACTOR,
    GrowthWatch,
    SnapshotJudge,
    Trend,
    read_trend,
)
from lightning_nanguard.signals.batch import BatchFindings
from lightning_nanguard.signals.history import read_history
from tests.helpers import TinyModel, make_trainer

CALM = StepHealth(grad_norm=1.29, loss=0.517)
RUNAWAY = StepHealth(grad_norm=2.33e12, loss=5.78e15)  # spike-then-diverge's step-50 reading
RISING = [(44 + i, 10.0**i, 10.0 ** (i + 1)) for i in range(7)]


def _findings(**kw: Any) -> Findings:
    return Findings(signal=Signal.DIVERGING, history=read_history(RISING), **kw)


def _history(levels: dict[int, float], steps: int = 60) -> list[tuple[int, float, float | None]]:
    """Finite readings at a calm level, times ``levels[step]`` where given."""
    return [(s, CALM.grad_norm * levels.get(s, 1.0), (CALM.loss or 0.0) * levels.get(s, 1.0)) for s in range(steps)]


GROWING = {s: 30.0 ** (s - 43) for s in range(44, 60)}  # geometric growth from step 44: a divergence
JUMP = dict.fromkeys(range(44, 60), 1000.0)  # a jump at step 44 that holds (a new data domain, a plateau)
FALLING = {s: 1000.0 / 1.25 ** (s - 44) for s in range(44, 60)}  # a jump at step 44 that falls by itself


@pytest.mark.parametrize(
    ("levels", "up_to", "expected"),
    [
        (GROWING, 50, Trend.GROWING),  # kept growing past the jump, up to the snapshot already
        (JUMP, 50, Trend.UNDECIDED),  # as high as a divergence, but not growing: nothing to act on
        (JUMP, 59, Trend.UNDECIDED),  # a level that holds stays undecided (a later snapshot settles it)
        (FALLING, 50, Trend.UNDECIDED),  # not yet fallen from its peak by half in the smoothed readings
        (FALLING, 59, Trend.TURNED),
        ({**JUMP, **dict.fromkeys(range(51, 60), 1.0)}, 59, Trend.TURNED),  # fell back below the factor
        ({50: 1e3}, 50, Trend.UNDECIDED),  # one hard batch at the snapshot step: too early to tell
        ({50: 1e3}, 59, Trend.TURNED),  # ... and gone
        ({48: 1e3, 50: 1e3}, 59, Trend.TURNED),  # two of five never lift the smoothed readings
        (dict.fromkeys(range(1, 51), 1000.0), 59, Trend.TURNED),  # every step after the reference as high: it was odd
    ],
)
def test_a_suspect_is_decided_by_the_trend_after_its_jump(
    levels: dict[int, float], up_to: int, expected: Trend
) -> None:
    seen = Divergence(50, StepHealth(CALM.grad_norm * 1e3, (CALM.loss or 0.0) * 1e3), 0, CALM, DIVERGED_FACTOR)
    history = [r for r in _history(levels) if r[0] <= up_to]
    assert read_trend(seen, history) is expected
    # Nothing read near the reference (evicted from the history): its own reading stands in; the trend is the same
    # wherever the readings near the reference were calm.
    if 1 not in levels:
        assert read_trend(seen, [r for r in history if r[0] >= 40]) is expected


def test_growth_is_decided_a_few_steps_after_passing_the_factor_whatever_the_height_of_the_jump() -> None:
    # A divergence growing 3x per step from step 41: its smoothed readings pass the factor at step 45 and have grown
    # 10x more by step 48. The same growth on top of a 30x jump passes the factor at step 43: decided at 46.
    slow = {s: 3.0 ** (s - 40) for s in range(41, 60)}
    jumped = {s: 30.0 * 3.0 ** (s - 40) for s in range(41, 60)}
    seen = Divergence(50, StepHealth(1.0, 1.0), 0, CALM, DIVERGED_FACTOR)

    def decided(levels: dict[int, float]) -> int:
        return next(n for n in range(45, 60) if read_trend(seen, _history(levels, n + 1)) is Trend.GROWING)

    assert (decided(slow), decided(jumped)) == (48, 46)


# ------------------------------------------------------------------------------------------------ diagnosis
def test_the_judge_keeps_what_it_saw_of_the_snapshot_judged_unsound() -> None:
    judge = SnapshotJudge()
    judge.judge(0, CALM)
    judge.judge(50, RUNAWAY)
    assert judge.last_divergence == Divergence(50, RUNAWAY, 0, CALM, DIVERGED_FACTOR)
    judge.reset()
    assert judge.last_divergence is None


def test_diverging_is_a_gradient_explosion_that_says_what_was_seen() -> None:
    f = _findings(divergence=Divergence(50, RUNAWAY, 0, CALM, DIVERGED_FACTOR))
    assert not needs_replay(f)  # the history settles it: no replay of a batch that has not run yet
    d = classify(f)
    assert d.cause is Cause.GRADIENT_EXPLOSION
    assert d.where == (
        "the snapshot of step 50: loss 5.78e+15, grad norm 2.33e+12, against 0.517 and 1.29 at the last sound "
        "snapshot (step 0)"
    )
    seen, history = d.evidence
    assert (seen.kind, history.kind) == (EvidenceKind.HISTORY_RISING, EvidenceKind.HISTORY_RISING)
    assert "loss 1.12e+16x and grad norm 1.81e+12x" in seen.summary
    assert seen.values["step"] == 50
    assert seen.values["reference_step"] == 0
    assert "(rising)" in history.summary
    assert d.hint  # the explosion's: lower the learning rate, ...
    assert not d.state_damaged
    assert not d.rows


def test_diverging_is_not_blamed_on_the_batch_about_to_run() -> None:
    # The event is found at a batch start: that batch has not touched the weights.
    bad = BatchFindings(nonfinite_rows=(3,))
    d = classify(_findings(divergence=Divergence(50, RUNAWAY, 0, CALM, DIVERGED_FACTOR), batch=(bad,)))
    assert d.cause is Cause.GRADIENT_EXPLOSION
    assert not d.rows


def test_diverging_without_the_restorers_verdict_still_names_the_history() -> None:
    d = classify(_findings())
    assert d.cause is Cause.GRADIENT_EXPLOSION
    assert d.evidence[0].kind is EvidenceKind.HISTORY_RISING
    no_loss = classify(
        _findings(divergence=Divergence(50, StepHealth(30.0, None), None, StepHealth(1.0, None), DIVERGED_FACTOR))
    )
    assert "loss ?, grad norm 30" in no_loss.where
    assert "last sound snapshot," not in no_loss.where  # no step to name


# ------------------------------------------------------------------------------------------------ remedy
ALL = Installed(drop=True, quarantine=True, rollback=True, backoff=True, eps_backoff=True)


def _plan(**kw: Any) -> tuple[Action, ...]:
    facts = RemedyFacts(
        signal=Signal.DIVERGING, cause=Cause.GRADIENT_EXPLOSION, has_update=False, **{"installed": ALL, **kw}
    )
    return plan_remedy(facts).actions


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, (Action.ROLLBACK, Action.BACKOFF)),  # as for an explosion; nothing to drop (no update at stake)
        ({"installed": Installed(drop=True, rollback=True)}, (Action.ROLLBACK,)),
        ({"backoff_triggers": frozenset({"skip"})}, (Action.ROLLBACK,)),  # OptimizerBackoff not on rollbacks
        ({"can_restore": False}, (Action.BACKOFF,)),
        ({"rollback_budget_left": 0}, (Action.ROLLBACK, Action.BACKOFF, Action.STOP)),
        ({"installed": Installed(drop=True)}, ()),  # nothing to restore with: reported, nothing done
        ({"skip_streak": 9, "max_consecutive_skips": 3}, (Action.ROLLBACK, Action.BACKOFF)),  # no drop escalation
    ],
)
def test_diverging_plans_a_rollback_and_a_backoff(kw: dict[str, Any], expected: tuple[Action, ...]) -> None:
    assert _plan(**kw) == expected


# ------------------------------------------------------------------------------------------------ a real fit
class _Runaway(TinyModel):
    """From ``start`` on, for ``steps`` steps, the loss is ``factor`` x larger (its gradient too), and ``growth`` x
    more at each step after the first: what a snapshot taken mid-divergence reads (``growth`` > 1) or one taken during
    a jump that holds (``growth`` = 1), on a learning rate small enough that nothing goes non-finite."""

    def __init__(self, start: int | None, steps: int, factor: float, growth: float) -> None:
        super().__init__(lr=1e-6, optimizer="sgd")
        self.start, self.steps, self.factor, self.growth = start, steps, factor, growth

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.start is not None and self.start <= self.global_step < self.start + self.steps:
            loss = loss * self.factor * self.growth ** (self.global_step - self.start)
        return loss


def _fit(
    tmp_path: pathlib.Path, start: int | None, steps: int = 6, factor: float = 1e4, growth: float = 1.0
) -> list[Any]:
    trainer = make_trainer(
        tmp_path, max_steps=20, callbacks=[AutoRollback(every_n_steps=8, quiet_steps=0), OptimizerBackoff()]
    )
    trainer.fit(_Runaway(start, steps, factor, growth))
    return list(get_engine(trainer).sink.records)


def test_a_snapshot_taken_mid_divergence_is_rolled_back_at_the_next_step(tmp_path: pathlib.Path) -> None:
    # Steps 4-9 read 30x, 900x, ... the healthy level: the step-8 snapshot is a suspect, and the steps up to it grew
    # another 10x after passing the factor.
    (incident,) = _fit(tmp_path, start=4, factor=30.0, growth=30.0)
    assert (incident.trigger, incident.step, incident.cause) == ("diverging", 9, "gradient_explosion")
    assert incident.actions == ["rollback", "backoff"]
    assert incident.values["restored_from_step"] == 0
    assert incident.values["lr_notches"] == 2  # the step-8 snapshot was passed over
    assert incident.where.startswith("the snapshot of step 8: ")


@pytest.mark.parametrize(
    ("start", "steps"),
    [
        (None, 0),  # healthy
        (9, 6),  # between snapshots: none read it
        (8, 1),  # one odd batch at the snapshot step: a suspect until the steps after it show nothing, not acted on
        (4, 6),  # steps 4-9 read 1e4x, the step-8 snapshot and the steps before it too: a jump that holds, then ends
        (6, 12),  # a jump that holds past the next snapshot: a new level
    ],
)
def test_no_divergence_is_acted_on_without_one(tmp_path: pathlib.Path, start: int | None, steps: int) -> None:
    assert _fit(tmp_path, start=start, steps=steps) == []


def test_growth_of_a_squared_error_is_growth_of_its_loss_with_its_gradient_norm_growing_too() -> None:
    # A squared error's loss grows as the square of its gradient norm: 10x past the factor in the loss and 3x in the
    # gradient norm is a divergence; 10x in the loss with a gradient norm that holds is not (a hard stretch of data).
    seen = Divergence(50, StepHealth(CALM.grad_norm * 1e3, (CALM.loss or 0.0) * 1e3), 0, CALM, DIVERGED_FACTOR)

    def history(grad: dict[int, float], loss: dict[int, float]) -> list[tuple[int, float, float | None]]:
        return [(s, CALM.grad_norm * grad.get(s, 1.0), (CALM.loss or 0.0) * loss.get(s, 1.0)) for s in range(60)]

    squared = {s: 30.0 * 1.5 ** (s - 44) for s in range(44, 60)}
    assert read_trend(seen, history(squared, {s: v * v for s, v in squared.items()})) is Trend.GROWING
    flat = dict.fromkeys(range(44, 60), 30.0)
    assert read_trend(seen, history(flat, {s: v * v for s, v in squared.items()})) is Trend.UNDECIDED
    # No loss to read (manual optimization): the gradient norm alone.
    no_loss = [(s, g, None) for s, g, _ in history(squared, {})]
    assert read_trend(Divergence(50, StepHealth(1e3), 0, StepHealth(CALM.grad_norm), DIVERGED_FACTOR), no_loss) is (
        Trend.GROWING
    )


def test_following_one_reading_at_a_time_is_reading_it_all_at_once() -> None:
    seen = Divergence(50, StepHealth(CALM.grad_norm * 1e3, (CALM.loss or 0.0) * 1e3), 0, CALM, DIVERGED_FACTOR)
    for levels in (GROWING, JUMP, FALLING, {50: 1e3}):
        readings = _history(levels)
        watch = GrowthWatch.start(seen, [r for r in readings if r[0] <= 50])
        for n in range(51, 60):
            watch.feed(readings[: n + 1])
            assert watch.verdict() is read_trend(seen, readings[: n + 1]), (levels, n)
