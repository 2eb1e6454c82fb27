"""The pure logic behind LossScaleWatchdog: the host mirror of the GradScaler, the collapse rule, the diagnosis."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_nanguard.policies.loss_scale import CollapsePolicy, ScaleMirror, diagnose, to_float32
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.signals.tensors import all_finite


@pytest.mark.parametrize("seed", range(4))
def test_mirror_replays_torch_update_exactly(seed: int) -> None:
    # Non-power-of-two factors make the float32 rounding visible; the mirror must match torch bit for bit.
    rng = random.Random(seed)
    growth, backoff, interval = rng.uniform(1.1, 4.0), rng.uniform(0.1, 0.9), rng.randint(1, 3)
    low, high = 0.37, 3.0e6
    scale = torch.tensor(rng.uniform(1.0, 1e5))
    tracker = torch.tensor(0, dtype=torch.int32)
    mirror = ScaleMirror(scale.item(), 0, growth, backoff, interval, low, high)
    for _ in range(200):
        bad = rng.random() < 0.4
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(bad)), growth, backoff, interval)
        scale.clamp_(min=low, max=high)
        assert mirror.update(bad) == scale.item()
        assert mirror.growth_tracker == tracker.item()


def test_mirror_skips_growth_to_inf_and_never_goes_below_the_floor() -> None:
    mirror = ScaleMirror(3.0e38, 0, 2.0, 0.5, 1, min_scale=1.0)
    assert mirror.update(False) == to_float32(3.0e38)  # torch drops a growth that would overflow to inf
    mirror = ScaleMirror(4.0, 0, 2.0, 0.5, 2000, min_scale=1.0)
    assert [mirror.update(True) for _ in range(4)] == [2.0, 1.0, 1.0, 1.0]
    assert mirror.at_floor
    assert not mirror.resync(1.0, 0)
    assert mirror.resync(8.0, 3)
    assert (mirror.scale, mirror.growth_tracker, mirror.at_floor) == (8.0, 3, False)


def test_to_float32_rounds_and_overflows_like_torch() -> None:
    for value in (0.1, 1e-45, 2.0**-150, 3.4e38, 3.5e38, math.inf):
        assert to_float32(value) == torch.tensor(value, dtype=torch.float64).float().item()


def test_streak_rule_collapses_at_the_mth_overflow_in_a_row() -> None:
    policy = CollapsePolicy(on_collapse="warn", floor_patience=None, max_overflow_streak=3, max_collapses=None)
    flags = [True, True, False, True, True, True]
    assert [policy.observe(f, at_floor=False) for f in flags] == [Action.NONE] * 5 + [Action.WARN]
    assert policy.reason == "streak"
    assert (policy.overflow_steps, policy.streak, policy.collapses, policy.budget_left) == (5, 3, 1, -1)


def test_floor_rule_counts_overflows_at_the_floor_until_one_happens_above_it() -> None:
    policy = CollapsePolicy(on_collapse="rollback", floor_patience=2, max_overflow_streak=None)
    assert policy.observe(True, at_floor=True) is Action.NONE
    assert policy.observe(False, at_floor=True) is Action.NONE  # a finite step at the floor does not reset
    assert policy.observe(True, at_floor=False) is Action.NONE  # the scale had grown off the floor: reset
    assert policy.floor_hits == 0
    assert policy.observe(True, at_floor=True) is Action.NONE
    assert policy.observe(True, at_floor=True) is Action.ROLLBACK
    assert policy.reason == "floor"


def test_collapse_budget_then_stop() -> None:
    policy = CollapsePolicy(on_collapse="warn", floor_patience=None, max_overflow_streak=1, max_collapses=2)
    actions = []
    for _ in range(3):
        actions.append(policy.observe(True, at_floor=False))
        policy.reset_streaks()
    assert actions == [Action.WARN, Action.WARN, Action.STOP]
    assert policy.budget_exhausted
    assert CollapsePolicy(on_collapse="stop", max_overflow_streak=1).observe(True, False) is Action.STOP


def test_overflow_rate_is_over_the_window() -> None:
    policy = CollapsePolicy(floor_patience=None, max_overflow_streak=None, window=4)
    for flag in (True, True, False, False, False, True):
        policy.observe(flag, at_floor=False)
    assert policy.overflow_rate == 0.25
    assert CollapsePolicy().overflow_rate == 0.0


@pytest.mark.parametrize(
    ("weights_finite", "finite_steps", "resumed_from", "kind", "says"),
    [
        (False, 0, "/runs/last.ckpt", "nonfinite_weights_from_checkpoint", "resuming from '/runs/last.ckpt'"),
        (False, 5, "/runs/last.ckpt", "nonfinite_weights", "Restore an earlier checkpoint"),
        (False, 0, None, "nonfinite_weights", "no loss scale can recover"),
        (True, 0, "/runs/last.ckpt", "overflow_since_resume", "since resuming from '/runs/last.ckpt'"),
        (True, 0, None, "overflow_from_start", "bf16-mixed"),
        (True, 7, "/runs/last.ckpt", "loss_exploding", "after 7 finite steps"),
    ],
)
def test_diagnosis(weights_finite: bool, finite_steps: int, resumed_from: str | None, kind: str, says: str) -> None:
    d = diagnose(weights_finite=weights_finite, finite_steps=finite_steps, resumed_from=resumed_from)
    assert d.kind == kind
    assert says in d.advice
    assert ("lowering the learning rate" in d.advice) == (kind == "loss_exploding")


def test_wide_all_finite_is_one_fused_verdict() -> None:
    big = torch.full((4,), 3.0e38)  # finite, though its float32 2-norm would overflow
    assert bool(all_finite([big, torch.ones(3, dtype=torch.float16)], wide=True))
    assert not bool(all_finite([torch.ones(2), torch.tensor([1.0, math.nan])], wide=True))
    assert not bool(all_finite([torch.tensor([-math.inf], dtype=torch.bfloat16)], wide=True))
    assert bool(all_finite([], wide=True))
