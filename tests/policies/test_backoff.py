"""BackoffPolicy (when/how far/recovery) and the preflight findings: pure."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_nanguard.policies.backoff import BackoffPolicy, parse_triggers
from lightning_nanguard.policies.preflight import GroupInfo, OptimizerInfo, min_safe_eps, preflight_findings
from lightning_nanguard.policies.snapshot_rates import RestoredRates


def test_parse_triggers() -> None:
    assert parse_triggers(" rollback, skip ,") == {"rollback", "skip"}
    with pytest.raises(ValueError, match=r"unknown trigger\(s\) \['rolback'\]"):
        parse_triggers("rolback")


def test_each_backoff_multiplies_the_scale_down_to_the_floor() -> None:
    p = BackoffPolicy(lr_factor=0.5, min_lr_scale=0.2)
    scales = [p.back_off("gradient_explosion").after for _ in range(4)]
    assert scales == [0.5, 0.25, 0.2, 0.2]
    assert p.backoffs == 3  # the last one was at the floor: nothing changed


@pytest.mark.parametrize("recover_steps", [1, 2, 3])
def test_recovery_climbs_back_in_notches_after_healthy_steps(recover_steps: int) -> None:
    p = BackoffPolicy(lr_factor=0.5, recover_after=4, recover_steps=recover_steps)
    p.back_off("x")
    p.last_event_step = 10  # the event's pre-step global_step
    scales = []
    for gs in range(11, 40):  # post-step global_step at on_train_batch_end
        change = p.tick(gs)
        if change is not None:
            scales.append((gs, change.after))
    assert [gs for gs, _ in scales] == [15 + 4 * k for k in range(recover_steps)]
    assert scales[-1][1] == 1.0
    assert scales[0][1] == pytest.approx(0.5 * 2 ** (1 / recover_steps))


def test_an_event_resets_recovery() -> None:
    p = BackoffPolicy(recover_after=3)
    p.back_off("x")
    p.last_event_step = 0
    assert p.tick(3) is None
    p.last_event_step = 3  # a lone skip: no backoff, but the run is not healthy
    assert p.tick(4) is None
    assert p.tick(6) is None
    assert p.tick(7) is not None


@settings(max_examples=40, deadline=None)
@given(
    factor=st.floats(min_value=0.05, max_value=0.95),
    floor=st.floats(min_value=1e-3, max_value=1.0),
    n=st.integers(min_value=1, max_value=30),
)
def test_scale_is_factor_power_clamped_at_the_floor(factor: float, floor: float, n: int) -> None:
    p = BackoffPolicy(lr_factor=factor, min_lr_scale=floor)
    for _ in range(n):
        p.back_off("x")
    assert p.scale == pytest.approx(max(factor**n, floor), rel=1e-9)
    assert floor <= p.scale <= 1.0


def _info(eps: float | None, dtype: torch.dtype, fused: bool = False, fws: bool = False) -> OptimizerInfo:
    return OptimizerInfo(0, "AdamW", (GroupInfo(eps, fused, (dtype,)),), fused_with_scaler=fws)


def test_min_safe_eps() -> None:
    assert min_safe_eps(torch.float16) == pytest.approx(6.1035e-5, rel=1e-3)
    assert min_safe_eps(torch.bfloat16) < 1e-30


@pytest.mark.parametrize(
    ("eps", "dtype", "fused", "expect"),
    [
        (1e-8, torch.float16, False, True),  # 0 in fp16: the TRELLIS case
        (1e-7, torch.float16, False, True),  # subnormal
        (1e-6, torch.float16, False, True),
        (1e-4, torch.float16, False, False),
        (1e-8, torch.float16, True, False),  # the fused kernel computes in fp32
        (1e-8, torch.bfloat16, False, False),
        (1e-8, torch.float32, False, False),
        (None, torch.float16, False, False),  # SGD: no eps
    ],
)
def test_eps_underflow_finding(eps: float | None, dtype: torch.dtype, fused: bool, expect: bool) -> None:
    found = [
        f
        for f in preflight_findings([_info(eps, dtype, fused)], clip=False, safe_eps=1e-4)
        if f.code == "eps_underflow"
    ]
    assert bool(found) is expect
    if expect:
        assert found[0].fixable
        assert found[0].fix_eps == 1e-4
        assert "float16" in found[0].message
        assert "fused=True" in found[0].message


def test_fix_eps_is_at_least_the_smallest_normal() -> None:
    (f,) = [f for f in preflight_findings([_info(1e-8, torch.float16)], clip=False, safe_eps=1e-6) if f.fix_eps]
    assert f.fix_eps == pytest.approx(min_safe_eps(torch.float16))


def test_fused_scaler_clip_and_half_master() -> None:
    codes = [f.code for f in preflight_findings([_info(1e-8, torch.float32, True, True)], clip=True, safe_eps=1e-4)]
    assert codes == ["fused_scaler_clip"]
    assert preflight_findings([_info(1e-8, torch.float32, True, True)], clip=False, safe_eps=1e-4) == []
    codes = [f.code for f in preflight_findings([_info(1e-3, torch.bfloat16)], clip=False, safe_eps=1e-4)]
    assert codes == ["half_master"]


def test_a_recovered_level_that_does_not_last_is_never_climbed_to_again() -> None:
    p = BackoffPolicy(lr_factor=0.5, recover_after=10)
    p.back_off("gradient_explosion", step=1)
    p.last_event_step = 0
    assert p.tick(11) is not None  # 0.5 -> 1.0
    assert p.scale == 1.0
    p.back_off("gradient_explosion", step=15)  # 4 steps after the notch: 1.0 did not last
    assert p.scale == 0.5
    assert p.ceiling == 0.5
    p.last_event_step = 14
    assert all(p.tick(s) is None for s in range(15, 200))  # recovery stops below the level that failed
    # A backoff long after a notch says nothing about that level: recovery climbs back to it.
    q = BackoffPolicy(lr_factor=0.5, recover_after=10)
    q.back_off("x", step=1)
    q.last_event_step = 0
    q.back_off("x", step=5)  # 0.25
    q.last_event_step = 4
    assert q.tick(15) is not None  # 0.25 -> 0.5
    q.back_off("x", step=100)
    assert q.ceiling == 1.0
    q.last_event_step = 99
    assert q.tick(110) is not None
    assert q.tick(121) is not None
    assert q.scale == 1.0


def test_the_ceiling_travels_with_the_callback_state_and_older_state_loads() -> None:
    from lightning_nanguard import OptimizerBackoff

    cb = OptimizerBackoff(recover_after=10)
    cb._policy.ceiling = 0.25
    restored = OptimizerBackoff(recover_after=10)
    restored.load_state_dict(cb.state_dict())
    assert restored._policy.ceiling == 0.25
    older = {k: v for k, v in cb.state_dict().items() if k != "lr_ceiling"}
    restored.load_state_dict(older)
    assert restored._policy.ceiling == 1.0


def test_follow_schedule_caps_the_rate_and_climbs_back_as_the_schedule_falls_below_the_cap() -> None:
    p = BackoffPolicy(follow_schedule=True)
    p.back_off("gradient_explosion", lr=0.6)  # the schedule at 0.6, scale 1 -> 0.5: capped at 0.3
    assert (p.scale, p.cap) == (0.5, pytest.approx(0.3))
    assert p.follow(lr=0.3) is None  # the schedule still at 0.6: nothing to climb
    change = p.follow(lr=0.5 * 0.4)  # the schedule fell to 0.4: the scale may climb to 0.75, the rate to 0.3
    assert change is not None
    assert (change.before, change.after, change.cause) == (0.5, pytest.approx(0.75), "schedule")
    assert p.follow(lr=0.75 * 0.2) is not None  # the schedule at 0.2, below the cap: back to the schedule
    assert p.scale == 1.0
    assert p.follow(lr=0.1) is None
    # A warm restart: the schedule back up to 0.6, then 1.2. The scale comes down to hold the rate at the cap: a
    # rate too high once is too high again.
    assert p.follow(lr=1.0 * 0.6) is not None
    assert p.scale == 0.5
    assert p.follow(lr=0.5 * 1.2) is not None
    assert p.scale == pytest.approx(0.25)


def test_follow_schedule_holds_the_rate_at_the_cap_through_a_rising_schedule() -> None:
    p = BackoffPolicy(follow_schedule=True)
    p.back_off("weights_diverging", lr=0.22, ran_at=0.2)  # diverged during a warmup at 0.2; the schedule now at 0.22
    assert p.cap == pytest.approx(0.1)  # one notch below the rate the diverging step ran with
    assert p.scale == pytest.approx(0.1 / 0.22)  # held at the cap from the next step on
    for schedule in (0.3, 0.6, 1.0, 1.0):  # the warmup goes on rising, then holds
        p.follow(lr=schedule * p.scale)
        assert schedule * p.scale == pytest.approx(0.1)
    assert p.follow(lr=0.1) is None  # constant: nothing moves
    assert p.follow(lr=0.05 * p.scale) is not None  # the schedule decays to 0.05, below the cap: its own rate again
    assert p.scale == 1.0
    off = BackoffPolicy()
    off.back_off("gradient_explosion", lr=0.6)
    assert off.cap is None
    assert off.follow(lr=0.01) is None


def test_the_cap_goes_back_to_the_rate_the_restored_state_trained_at() -> None:
    # A constant rate of 0.075 jumped to 0.75; the restored state had trained at 0.075 (``trained``): the rate
    # comes back to it, however far below one notch of the rate that diverged it is.
    p = BackoffPolicy(follow_schedule=True)
    p.back_off("weights_diverging", lr=0.75, ran_at=0.75, restored=RestoredRates(taken=0.075, trained=0.075))
    assert p.cap == pytest.approx(0.075)
    assert p.scale == pytest.approx(0.1)
    # Without a proven rate (a snapshot from the start of the fit), the rate it was taken at bounds the cap only down
    # to one further notch: a warmup's first rate says nothing about a stable one.
    q = BackoffPolicy(follow_schedule=True)
    q.back_off("weights_diverging", lr=0.75, ran_at=0.75, restored=RestoredRates(taken=0.075))
    assert q.cap == pytest.approx(0.1875)
    # A state proven at the very rate that diverged proves nothing (it was taken as the climb began): as if unknown.
    r = BackoffPolicy(follow_schedule=True)
    r.back_off("weights_diverging", lr=0.3, ran_at=0.3, restored=RestoredRates(taken=0.0075, trained=0.3))
    assert r.cap == pytest.approx(0.075)  # two notches: the taken rate's one-notch floor
    # A proven rate above one notch below does not raise the cap.
    s = BackoffPolicy(follow_schedule=True)
    s.back_off("weights_diverging", lr=0.4, ran_at=0.4, restored=RestoredRates(trained=0.3))
    assert s.cap == pytest.approx(0.2)
