"""scale_schedule / sync_lr_scale against every torch scheduler: the backed-off schedule is factor x the reference."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim import lr_scheduler as S

from lightning_nanguard.recovery.backoff import (
    LR_SCALE_KEY,
    lr_scale_of,
    scale_eps,
    scale_schedule,
    stamp_lr_scale,
    sync_eps_scale,
    sync_lr_scale,
)

Factory = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, Factory] = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda s: min(1.0, (s + 1) / 8)),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=60),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=1e-3),  # passes its restart branch
    "CosineAnnealingLR_eta0": lambda o: S.CosineAnnealingLR(o, T_max=7),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=5, eta_min=1e-3),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, 0.1, total_iters=5), S.CosineAnnealingLR(o, T_max=10, eta_min=1e-3)], milestones=[5]
    ),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.StepLR(o, 4, 0.5), S.ExponentialLR(o, 0.97)]),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4),
    "StepLR": lambda o: S.StepLR(o, 5, 0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, [3, 9], 0.3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, 0.9),
    "LinearLR": lambda o: S.LinearLR(o, 0.2, total_iters=10),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=20, power=2.0),
    "ConstantLR": lambda o: S.ConstantLR(o, 0.5, total_iters=6),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda s: 0.95),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=1, min_lr=2e-3),
}
REQUIRED = ["LambdaLR", "OneCycleLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "SequentialLR"]


def _setup(name: str, groups: int = 2) -> tuple[torch.optim.Optimizer, Any]:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    opt = torch.optim.SGD([{"params": [p], "lr": 0.05 * (i + 1)} for i, p in enumerate(params)], momentum=0.9)
    return opt, SCHEDULERS[name](opt)


def _step(opt: torch.optim.Optimizer, sched: Any, t: int) -> None:
    opt.step()  # no grads: a no-op update, but the scheduler sees a real step() call
    if isinstance(sched, S.ReduceLROnPlateau):
        sched.step(1.0)  # a constant metric: a plateau, so it reduces (and hits min_lr) on schedule
    else:
        sched.step()


def _lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def _run(name: str, steps: int, at: int | None = None, factor: float = 1.0, lr_only: bool = False) -> list[list[float]]:
    opt, sched = _setup(name)
    out = []
    for t in range(steps):
        _step(opt, sched, t)
        if t == at:
            if lr_only:
                for g in opt.param_groups:
                    g["lr"] *= factor
            else:
                scale_schedule(opt, [sched], factor)
        out.append(_lrs(opt))
    return out


def _assert_ratio(ref: list[list[float]], got: list[list[float]], factor: float, start: int) -> None:
    for t in range(start, len(ref)):
        for r, g in zip(ref[t], got[t], strict=True):
            assert g == pytest.approx(factor * r, rel=1e-9, abs=1e-15), (t, r, g)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_backoff_persists_for_every_scheduler(name: str) -> None:
    ref = _run(name, 40)
    got = _run(name, 40, at=3, factor=0.5)
    _assert_ratio(ref, got, 0.5, start=3)
    assert got[:3] == ref[:3]


@pytest.mark.parametrize("name", ["LambdaLR", "OneCycleLR", "CyclicLR", "CosineAnnealingWarmRestarts"])
def test_scaling_lr_alone_is_lost(name: str) -> None:
    # The control: without the anchors the next scheduler step undoes the backoff. This is why scale_schedule exists.
    ref = _run(name, 12)
    got = _run(name, 12, at=3, factor=0.5, lr_only=True)
    assert any(g[0] == pytest.approx(r[0]) for r, g in zip(ref[5:], got[5:], strict=True))


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULERS)),
    factor=st.floats(min_value=0.01, max_value=1.0),
    at=st.integers(min_value=0, max_value=25),
)
def test_backed_off_schedule_is_factor_times_reference(name: str, factor: float, at: int) -> None:
    ref = _run(name, 30)
    got = _run(name, 30, at=at, factor=factor)
    _assert_ratio(ref, got, factor, start=at)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(SCHEDULERS)),
    factor=st.floats(min_value=0.01, max_value=1.0),
    at=st.integers(min_value=0, max_value=12),
    gap=st.integers(min_value=0, max_value=8),
)
def test_factor_then_inverse_restores_the_schedule(name: str, factor: float, at: int, gap: int) -> None:
    opt_ref, sched_ref = _setup(name)
    opt, sched = _setup(name)
    for t in range(30):
        _step(opt_ref, sched_ref, t)
        _step(opt, sched, t)
        if t == at:
            scale_schedule(opt, [sched], factor)
        if t == at + gap:
            scale_schedule(opt, [sched], 1.0 / factor)
        if t >= at + gap:
            for r, g in zip(_lrs(opt_ref), _lrs(opt), strict=True):
                assert g == pytest.approx(r, rel=1e-9, abs=1e-15)
    assert lr_scale_of(opt) == pytest.approx(1.0)


@pytest.mark.parametrize("name", [*REQUIRED, "ReduceLROnPlateau"])
def test_sync_reapplies_once_after_an_older_optimizer_state_is_restored(name: str) -> None:
    ref = _run(name, 30)
    opt, sched = _setup(name)
    stamp_lr_scale(opt, [sched])
    snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None
    for t in range(30):
        _step(opt, sched, t)
        if t == 2:
            snapshot = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
        if t == 5:
            sync_lr_scale(opt, [sched], 0.5)
        if t == 8:
            assert snapshot is not None
            opt.load_state_dict(copy.deepcopy(snapshot[0]))  # rollback of the optimizer only: scale lost there
            assert lr_scale_of(opt) == 1.0
            assert sync_lr_scale(opt, [sched], 0.5) is True
            assert sync_lr_scale(opt, [sched], 0.5) is False  # idempotent: exactly once
            for r, g in zip(ref[2], _lrs(opt), strict=True):
                assert g == pytest.approx(0.5 * r)
            # Put back the step-8 lr the reference has, as a restore that keeps the schedule position would.
            for g, r in zip(opt.param_groups, ref[8], strict=True):
                g["lr"] = 0.5 * r
        if t >= 5:
            for r, g in zip(ref[t], _lrs(opt), strict=True):
                assert g == pytest.approx(0.5 * r, rel=1e-9, abs=1e-15), (t, r, g)


def test_sync_is_right_when_optimizer_and_scheduler_disagree() -> None:
    opt, sched = _setup("OneCycleLR")
    stamp_lr_scale(opt, [sched])  # as OptimizerBackoff does at on_fit_start, before anyone snapshots
    for t in range(4):
        _step(opt, sched, t)
    old_sched = copy.deepcopy(sched.state_dict())
    sync_lr_scale(opt, [sched], 0.25)
    sched.load_state_dict(old_sched)  # the scheduler alone went back; the param groups kept their 0.25
    assert sched.nanguard_lr_scale == 1.0
    assert sync_lr_scale(opt, [sched], 0.25) is True
    assert sched.base_lrs == pytest.approx([0.1 / 25 * 0.25, 0.1 / 25 * 0.25])
    assert float(opt.param_groups[0]["max_lr"]) == pytest.approx(0.025)  # groups not scaled twice
    assert sched.nanguard_lr_scale == 0.25


def test_without_stamp_a_pre_record_scheduler_state_keeps_the_newer_record() -> None:
    # Documents why stamp_lr_scale exists: load_state_dict cannot remove an attribute.
    opt, sched = _setup("LambdaLR")
    old_sched = copy.deepcopy(sched.state_dict())
    sync_lr_scale(opt, [sched], 0.5)
    sched.load_state_dict(old_sched)
    assert getattr(sched, LR_SCALE_KEY) == 0.5
    assert sched.base_lrs == [0.05, 0.1]


def test_sync_survives_state_dict_round_trip_weights_only(tmp_path: Any) -> None:
    opt, sched = _setup("SequentialLR")
    _step(opt, sched, 0)
    scale_schedule(opt, [sched], 0.5)
    path = tmp_path / "s.pt"
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, path)
    loaded = torch.load(path, weights_only=True)
    opt2, sched2 = _setup("SequentialLR")
    _step(opt2, sched2, 0)
    opt2.load_state_dict(loaded["opt"])
    sched2.load_state_dict(loaded["sched"])
    assert sync_lr_scale(opt2, [sched2], 0.5) is False  # everything already carries its 0.5
    assert all(s.nanguard_lr_scale == 0.5 for s in [sched2, *sched2._schedulers])


def test_other_optimizers_schedulers_are_left_alone() -> None:
    opt_a, sched_a = _setup("LambdaLR")
    _opt_b, sched_b = _setup("LambdaLR")
    scale_schedule(opt_a, [sched_a, sched_b], 0.5)
    assert sched_b.base_lrs == [0.05, 0.1]
    assert sched_a.base_lrs == pytest.approx([0.025, 0.05])


def test_scale_schedule_rejects_bad_factors() -> None:
    opt, sched = _setup("StepLR")
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive finite"):
            scale_schedule(opt, [sched], bad)


def test_tensor_lr_is_scaled_in_place() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(0.1)
    opt = torch.optim.Adam([p], lr=lr)
    scale_schedule(opt, [], 0.5)
    assert opt.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(0.05)


def test_eps_scaling_caps_and_syncs() -> None:
    group: dict[str, Any] = {"eps": 1e-8}
    assert scale_eps(group, 10.0, max_eps=1e-3) == (1e-8, pytest.approx(1e-7))
    group = {"eps": 5e-4}
    assert scale_eps(group, 10.0, max_eps=1e-3)[1] == 1e-3  # capped
    group = {"eps": 0.1}
    assert scale_eps(group, 10.0, max_eps=1e-3)[1] == 0.1  # never lowered by the cap
    group = {"eps": 1e-4}
    assert sync_eps_scale(group, 100.0, max_eps=1.0) == (1e-4, pytest.approx(1e-2))
    assert sync_eps_scale(group, 100.0, max_eps=1.0) is None  # idempotent
    group["eps"], group["nanguard_eps_scale"] = 1e-4, 1.0  # an older state came back
    assert sync_eps_scale(group, 100.0, max_eps=1e-3) == (1e-4, 1e-3)
