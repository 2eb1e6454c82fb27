"""A snapshot taken mid-divergence is an event of its own (``Signal.DIVERGING``): its diagnosis, its remedy, and
``AutoRollback.diverging()`` reporting it once, the step after the snapshot, in a real fit."""

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
from lightning_nanguard.policies.snapshot_health import DIVERGED_FACTOR, SnapshotJudge, diverging_now
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


@pytest.mark.parametrize(
    ("levels", "expected"),
    [
        (dict.fromkeys(range(44, 51), 1000.0), True),  # every step up to the snapshot far up: diverging
        ({50: 1e3}, False),  # one hard batch at the snapshot step
        ({48: 1e3, 50: 1e3}, False),  # two of five
        (dict.fromkeys(range(1, 51), 1000.0), False),  # every step after the reference as high: the reference was odd
    ],
)
def test_acting_on_a_divergence_needs_the_steps_around_both_snapshots(levels: dict[int, float], expected: bool) -> None:
    seen = Divergence(50, StepHealth(CALM.grad_norm * 1e3, (CALM.loss or 0.0) * 1e3), 0, CALM, DIVERGED_FACTOR)
    assert diverging_now(seen, _history(levels)) is expected
    # Nothing read near the reference (evicted from the history): its own reading stands in.
    assert diverging_now(seen, [r for r in _history(levels) if r[0] >= 40]) is (expected or 1 in levels)


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
    """From ``start`` on, for ``steps`` steps, the loss is ``factor`` x larger (its gradient too): what a snapshot
    taken mid-divergence reads, on a learning rate small enough that nothing goes non-finite."""

    def __init__(self, start: int | None, steps: int = 2, factor: float = 1e4) -> None:
        super().__init__(lr=1e-6, optimizer="sgd")
        self.start, self.steps, self.factor = start, steps, factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.start is not None and self.start <= self.global_step < self.start + self.steps:
            loss = loss * self.factor
        return loss


def _fit(tmp_path: pathlib.Path, start: int | None, steps: int = 6) -> list[Any]:
    trainer = make_trainer(
        tmp_path, max_steps=20, callbacks=[AutoRollback(every_n_steps=8, quiet_steps=0), OptimizerBackoff()]
    )
    trainer.fit(_Runaway(start, steps))
    return list(get_engine(trainer).sink.records)


def test_a_snapshot_taken_mid_divergence_is_rolled_back_at_the_next_step(tmp_path: pathlib.Path) -> None:
    (incident,) = _fit(tmp_path, start=4)  # steps 4-9 read 1e4x: the step-8 snapshot, and the steps before it
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
        (8, 1),  # one odd batch at the snapshot step: judged unsound (passed over by a restore), not acted on
    ],
)
def test_no_divergence_is_acted_on_without_one(tmp_path: pathlib.Path, start: int | None, steps: int) -> None:
    assert _fit(tmp_path, start=start, steps=steps) == []
