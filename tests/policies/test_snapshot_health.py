"""Snapshots judged by their own step's reading: which were taken mid-divergence, and the restore passing over them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nanguard.contract import StepHealth
from lightning_nanguard.policies.backoff import BackoffPolicy
from lightning_nanguard.policies.rollback import RollbackPolicy, choose_sound
from lightning_nanguard.policies.snapshot_health import SnapshotJudge, diverged
from lightning_nanguard.recovery.snapshot import SnapshotRing

CALM = StepHealth(grad_norm=1.3, loss=0.5)
RUNAWAY = StepHealth(grad_norm=7e10, loss=2.7e14)  # spike-then-diverge's step-50 reading


@pytest.mark.parametrize(
    ("health", "expected"),
    [
        (RUNAWAY, True),
        (StepHealth(20.0, 8.0), True),  # both more than 10x
        (StepHealth(20.0, 0.6), False),  # one bad batch's gradient, the loss as usual
        (StepHealth(1.0, 50.0), False),  # a hard batch's loss, the gradient as usual
        (StepHealth(20.0, None), True),  # no loss (manual optimization): the gradient norm alone
        (StepHealth(20.0, -3.0), True),  # a negative loss has no ratio: the gradient norm alone
        (StepHealth(float("nan"), None), False),  # nothing comparable: not judged diverged
    ],
)
def test_diverged_needs_every_comparable_reading_far_above(health: StepHealth, expected: bool) -> None:
    assert diverged(health, CALM) is expected


def test_a_snapshot_taken_mid_divergence_is_unsound_and_the_reference_stays() -> None:
    judge = SnapshotJudge()
    assert judge.judge(0, CALM)
    assert not judge.judge(50, RUNAWAY)
    assert judge.unsound == {50}
    assert judge.reference == CALM  # the next snapshot is compared with the last sound one
    assert judge.judge(100, StepHealth(1.0, 0.2))
    assert judge.reference == StepHealth(1.0, 0.2)
    assert judge.judge(150, None)  # no reading: nothing says otherwise


def test_a_level_that_holds_without_an_incident_is_a_new_normal() -> None:
    judge = SnapshotJudge()
    judge.judge(0, CALM)
    assert not judge.judge(50, StepHealth(30.0, 12.0))  # a jump (a new data phase, or a divergence starting)
    assert judge.judge(100, StepHealth(25.0, 10.0))  # it held for a whole interval, nothing went wrong: vindicated
    assert judge.unsound == set()
    # Vindicated also when the unsound snapshot was evicted from the ring meanwhile (its verdict is forgotten).
    judge = SnapshotJudge()
    judge.judge(0, CALM)
    judge.judge(50, StepHealth(30.0, 12.0))
    judge.keep_only([0])
    assert judge.judge(100, StepHealth(25.0, 10.0))
    # A divergence keeps growing: not vindicated.
    judge = SnapshotJudge()
    judge.judge(0, CALM)
    judge.judge(50, StepHealth(30.0, 12.0))
    assert not judge.judge(100, StepHealth(3e4, 1e5))
    # Nor when an incident came in between.
    judge = SnapshotJudge()
    judge.judge(0, CALM)
    judge.judge(50, StepHealth(30.0, 12.0))
    assert not judge.judge(100, StepHealth(25.0, 10.0), incident_since_previous=True)


def test_a_restore_forgets_the_abandoned_trajectory() -> None:
    judge = SnapshotJudge()
    judge.judge(0, CALM)
    judge.judge(50, RUNAWAY)
    judge.restored(0)
    assert judge.unsound == set()
    assert judge.reference == CALM
    assert set(judge.healths) == {0}


def test_choose_sound_passes_over_snapshots_taken_mid_divergence() -> None:
    policy = RollbackPolicy(recurrence_steps=10)
    first = policy.decide(56)
    assert choose_sound(first, [0, 50], unsound={50}) == (0, (50,))
    assert choose_sound(first, [0, 50, 100], unsound={50, 100}) == (0, (100, 50))
    assert choose_sound(first, [0, 50], unsound=()) == (50, ())
    assert choose_sound(first, [50], unsound={50}) == (50, ())  # nothing sound: a finite state beats a non-finite one
    assert choose_sound(first, [], unsound=()) == (None, ())
    policy.record(56, 50)
    again = policy.decide(60)  # a recurrence: only snapshots older than the one restored last
    assert choose_sound(again, [0, 25, 50], unsound={25}) == (0, (25,))


def test_backoff_notches_multiply_down_to_the_floor() -> None:
    p = BackoffPolicy(lr_factor=0.5, min_lr_scale=0.1)
    assert p.back_off("gradient_explosion", notches=2).after == 0.25
    assert p.back_off("gradient_explosion", notches=3).after == 0.1  # 0.03125, floored
    assert p.backoffs == 2
    assert BackoffPolicy().back_off("x", notches=0).after == 0.5  # at least one notch


def test_ring_keeps_the_newest_sound_snapshot_while_newer_ones_are_unsound() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = SnapshotRing(2)
    for step in (0, 50):
        ring.take(model, [opt], step=step, log_step=step)
    ring.take(model, [opt], step=100, log_step=100, keep=0)  # 50 was taken mid-divergence: 0 stays
    assert ring.steps() == [0, 100]
    ring.take(model, [opt], step=150, log_step=150)  # no keep: the oldest goes
    assert ring.steps() == [100, 150]
    single = SnapshotRing(1)
    single.take(model, [opt], step=0, log_step=0)
    single.take(model, [opt], step=50, log_step=50, keep=0)  # one slot: the copy must go somewhere
    assert single.steps() == [50]
