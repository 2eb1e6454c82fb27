"""The pure logic behind LossScaleWatchdog: the collapse rules and their budget."""

from __future__ import annotations

import math

import torch

from lightning_nanguard.policies.loss_scale import CollapsePolicy
from lightning_nanguard.signals.tensors import all_finite


def test_streak_rule_collapses_at_the_mth_overflow_in_a_row() -> None:
    policy = CollapsePolicy(floor_patience=None, max_overflow_streak=3, max_collapses=None)
    flags = [True, True, False, True, True, True]
    assert [policy.observe(f, at_floor=False) for f in flags] == [False] * 5 + [True]
    assert policy.reason == "3 overflowing steps in a row (max_overflow_streak=3)"
    assert (policy.overflow_steps, policy.streak, policy.collapses, policy.budget_left) == (5, 3, 1, 1)


def test_floor_rule_counts_overflows_at_the_floor_until_one_happens_above_it() -> None:
    policy = CollapsePolicy(floor_patience=2, max_overflow_streak=None)
    assert not policy.observe(True, at_floor=True)
    assert not policy.observe(False, at_floor=True)  # a finite step at the floor does not reset
    assert not policy.observe(True, at_floor=False)  # the scale had grown off the floor: reset
    assert policy.floor_hits == 0
    assert not policy.observe(True, at_floor=True)
    assert policy.observe(True, at_floor=True)
    assert policy.reason.startswith("2 overflowing steps with the scale already at its floor")


def test_collapse_budget_counts_down_to_zero() -> None:
    policy = CollapsePolicy(floor_patience=None, max_overflow_streak=1, max_collapses=2)
    left = []
    for _ in range(3):
        assert policy.observe(True, at_floor=False)
        left.append(policy.budget_left)
        policy.reset_streaks()
    assert left == [2, 1, 0]  # 0: the third collapse is one too many (the engine stops)


def test_overflow_rate_is_over_the_window() -> None:
    policy = CollapsePolicy(floor_patience=None, max_overflow_streak=None, window=4)
    for flag in (True, True, False, False, False, True):
        policy.observe(flag, at_floor=False)
    assert policy.overflow_rate == 0.25
    assert CollapsePolicy().overflow_rate == 0.0


def test_wide_all_finite_is_one_fused_verdict() -> None:
    big = torch.full((4,), 3.0e38)  # finite, though its float32 2-norm would overflow
    assert bool(all_finite([big, torch.ones(3, dtype=torch.float16)], wide=True))
    assert not bool(all_finite([torch.ones(2), torch.tensor([1.0, math.nan])], wide=True))
    assert not bool(all_finite([torch.tensor([-math.inf], dtype=torch.bfloat16)], wide=True))
    assert bool(all_finite([], wide=True))
