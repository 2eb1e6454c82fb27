"""The remedy ladder (policies/remedy.py): facts in, a Plan out. The suite must not over-react."""

from __future__ import annotations

import pytest

from lightning_nanguard.contract import Action, Cause, Plan, Signal, StopReason
from lightning_nanguard.policies.remedy import (
    Installed,
    RemedyFacts,
    counts_as_dropped,
    dropped_budget,
    plan_remedy,
)

SUITE = Installed(drop=True, quarantine=True, rollback=True, backoff=True, eps_backoff=False, promote=True)
NAN = Signal.NONFINITE_LOSS_AND_GRADS


def plan(**kw: object) -> tuple[Action, ...]:
    facts = {"signal": NAN, "cause": Cause.UNKNOWN, "installed": SUITE, "max_consecutive_skips": 20, **kw}
    return plan_remedy(RemedyFacts(**facts)).actions  # type: ignore[arg-type]


def test_one_bad_sample_is_skipped_and_quarantined_never_rolled_back_or_backed_off() -> None:
    assert plan(cause=Cause.INPUT_DATA) == (Action.SKIP, Action.QUARANTINE)
    assert plan(cause=Cause.TARGETS) == (Action.SKIP, Action.QUARANTINE)


def test_bad_data_that_damaged_the_state_also_rolls_back() -> None:
    assert plan(cause=Cause.INPUT_DATA, state_damaged=True) == (Action.SKIP, Action.QUARANTINE, Action.ROLLBACK)


def test_a_transient_fault_is_only_skipped() -> None:
    assert plan(cause=Cause.TRANSIENT) == (Action.SKIP,)


def test_divergence_rolls_back_and_backs_off() -> None:
    assert plan(cause=Cause.GRADIENT_EXPLOSION) == (Action.SKIP, Action.ROLLBACK, Action.BACKOFF)


def test_a_spike_whose_probe_rose_rolls_back_and_backs_off_without_a_drop() -> None:
    # The update landed (the probe scored the weights it made): the rollback undoes it with the rest of the climb.
    probe = {"signal": Signal.PROBE_ROSE, "cause": Cause.WEIGHTS_DIVERGING, "on_spike": "probe"}
    assert plan(**probe) == (Action.ROLLBACK, Action.BACKOFF)
    assert plan(**probe, installed=Installed(drop=True, rollback=True)) == (Action.ROLLBACK,)
    assert plan(**probe, installed=Installed(drop=True, backoff=True)) == ()


def test_optimizer_numerics_raise_eps_only_where_it_applies() -> None:
    assert plan(cause=Cause.OPTIMIZER_NUMERICS) == (Action.SKIP,)
    eps = Installed(drop=True, eps_backoff=True, backoff=True)
    assert plan(cause=Cause.OPTIMIZER_NUMERICS, installed=eps) == (Action.SKIP, Action.EPS_BACKOFF)


def test_half_precision_overflow_promotes_the_module_once_it_recurs() -> None:
    kw = {"cause": Cause.HALF_PRECISION_OVERFLOW, "module": "attn", "promote_after": 2}
    assert plan(**kw, module_overflows=1) == (Action.SKIP,)
    assert plan(**kw, module_overflows=2) == (Action.SKIP, Action.PROMOTE)
    assert plan(**kw, module_overflows=2, true_half=True) == (Action.SKIP,)  # no autocast to switch off


def test_routine_gradscaler_overflow_is_the_scalers() -> None:
    assert plan(scaler_dropped=True, cause=Cause.HALF_PRECISION_OVERFLOW) == (Action.SCALER_SKIP,)


def test_ablation_removes_exactly_the_remedy_switched_off() -> None:
    no_rollback = Installed(drop=True, quarantine=True, backoff=True)
    assert plan(cause=Cause.GRADIENT_EXPLOSION, installed=no_rollback) == (Action.SKIP,)
    no_quarantine = Installed(drop=True, rollback=True, backoff=True)
    assert plan(cause=Cause.INPUT_DATA, installed=no_quarantine) == (Action.SKIP,)


def test_a_damaged_state_with_nothing_to_restore_stops() -> None:
    p = plan_remedy(RemedyFacts(NAN, Cause.CORRUPT_STATE, SUITE, state_damaged=True, can_restore=False))
    assert p.stop
    assert "no verified snapshot or checkpoint" in p.reason
    alone = plan_remedy(RemedyFacts(NAN, Cause.CORRUPT_STATE, Installed(drop=True), state_damaged=True))
    assert alone.stop
    assert "AutoRollback is not installed" in alone.reason


@pytest.mark.parametrize("rollback", [True, False])
def test_a_streak_of_dropped_updates_escalates(rollback: bool) -> None:
    installed = Installed(drop=True, rollback=rollback, backoff=True)
    p = plan_remedy(RemedyFacts(NAN, Cause.UNKNOWN, installed, skip_streak=4, max_consecutive_skips=3))
    if rollback:
        assert p.actions == (Action.SKIP, Action.ROLLBACK)  # no lower LR: it is not an unknown cause's remedy
        assert not p.stop
    else:
        assert p.stop
        assert "4 dropped updates in a row, more than max_consecutive_skips=3" in p.reason


def test_a_streak_lowers_the_lr_only_where_a_lower_lr_is_the_remedy() -> None:
    no_rollback = Installed(drop=True, backoff=True)
    kw = {"skip_streak": 4, "max_consecutive_skips": 3, "installed": no_rollback, "can_restore": False}
    assert plan(cause=Cause.GRADIENT_EXPLOSION, **{**kw, "installed": SUITE, "can_restore": True}) == (
        Action.SKIP,
        Action.ROLLBACK,
        Action.BACKOFF,
    )
    for cause in (Cause.LOSS_FUNCTION, Cause.TRANSIENT, Cause.HALF_PRECISION_OVERFLOW):
        assert plan(cause=cause, skip_streak=4, max_consecutive_skips=3) == (Action.SKIP, Action.ROLLBACK)
    assert plan_remedy(RemedyFacts(NAN, Cause.LOSS_FUNCTION, **kw)).stop  # type: ignore[arg-type]


def test_a_streak_of_bad_data_is_the_quarantines_never_an_escalation() -> None:
    # A corrupt shard: 25 bad batches in a row, each quarantined. No rollback, no LR cut, no stop.
    for installed in (SUITE, Installed(drop=True, quarantine=True, backoff=True)):
        for cause in (Cause.INPUT_DATA, Cause.TARGETS):
            facts = RemedyFacts(NAN, cause, installed, skip_streak=25, max_consecutive_skips=20, recent_skips=25)
            p = plan_remedy(facts)
            assert p.actions == (Action.SKIP, Action.QUARANTINE)
            assert p.stop is None


def test_only_causes_a_lower_lr_answers_back_off_once_enough_recur() -> None:
    no_rollback = Installed(drop=True, quarantine=True, backoff=True)
    assert plan(cause=Cause.GRADIENT_EXPLOSION, installed=no_rollback, recent_skips=2) == (Action.SKIP,)
    assert plan(cause=Cause.GRADIENT_EXPLOSION, installed=no_rollback, recent_skips=3) == (Action.SKIP, Action.BACKOFF)
    for cause in (Cause.UNKNOWN, Cause.LOSS_FUNCTION, Cause.TRANSIENT, Cause.HALF_PRECISION_OVERFLOW):
        assert plan(cause=cause, recent_skips=30) == (Action.SKIP,), cause
    assert plan(cause=Cause.INPUT_DATA, recent_skips=3) == (Action.SKIP, Action.QUARANTINE)


def _budget(**kw: object) -> Plan:
    facts = {
        "signal": NAN,
        "cause": Cause.LOSS_FUNCTION,
        "installed": SUITE,
        "max_dropped_fraction": 0.05,
        "dropped_window": 200,
        **kw,
    }
    return plan_remedy(RemedyFacts(**facts))  # type: ignore[arg-type]


def test_updates_dropped_for_a_cause_no_remedy_fixes_are_bounded_by_a_share_of_recent_steps() -> None:
    assert dropped_budget(0.05, 200) == 10
    assert _budget(dropped_before=9).stop is None  # the 10th drop in 200 steps: within the budget
    p = _budget(dropped_before=10)
    assert p.stop is StopReason.DROPPED_BUDGET
    assert p.actions == (Action.SKIP, Action.STOP)
    assert "11 of the last 200 updates were dropped, more than max_dropped_fraction=0.05" in p.reason
    assert "loss function" in p.reason
    assert _budget(dropped_before=10, max_dropped_fraction=None).stop is None


def test_the_dropped_budget_says_the_data_pipeline_is_broken_for_bad_data() -> None:
    p = _budget(cause=Cause.INPUT_DATA, dropped_before=10)
    assert p.stop is StopReason.DROPPED_BUDGET
    assert p.actions == (Action.SKIP, Action.QUARANTINE, Action.STOP)
    assert p.reason.startswith("the data pipeline is broken: 11 of the last 200 updates were dropped")


def test_the_dropped_budget_in_warn_mode_warns_once_as_it_is_crossed() -> None:
    assert _budget(dropped_before=10, on_dropped_budget="warn").actions == (Action.SKIP, Action.WARN)
    assert _budget(dropped_before=10, on_dropped_budget="warn").stop is None
    assert _budget(dropped_before=11, on_dropped_budget="warn").actions == (Action.SKIP,)


def test_drops_a_rollback_answers_and_routine_scaler_skips_do_not_count_toward_the_dropped_budget() -> None:
    rollback = _budget(cause=Cause.GRADIENT_EXPLOSION, dropped_before=50)
    assert rollback.stop is None
    assert not counts_as_dropped(RemedyFacts(NAN, Cause.GRADIENT_EXPLOSION, SUITE), rollback)
    routine = RemedyFacts(NAN, Cause.HALF_PRECISION_OVERFLOW, SUITE, scaler_dropped=True)
    assert not counts_as_dropped(routine, plan_remedy(routine))
    assert _budget(cause=Cause.HALF_PRECISION_OVERFLOW, scaler_dropped=True, dropped_before=50).stop is None
    overflow = RemedyFacts(NAN, Cause.HALF_PRECISION_OVERFLOW, SUITE)  # bf16 / 16-true: nanguard's own drop
    assert counts_as_dropped(overflow, plan_remedy(overflow))


def test_the_rollback_budget_stops_after_restoring() -> None:
    p = plan_remedy(RemedyFacts(NAN, Cause.GRADIENT_EXPLOSION, SUITE, rollback_budget_left=0))
    assert p.stop
    assert p.actions[:2] == (Action.SKIP, Action.ROLLBACK)


def test_warn_lets_the_update_through() -> None:
    p = plan_remedy(RemedyFacts(NAN, Cause.UNKNOWN, Installed(), on_nonfinite="warn"))
    assert p.actions == (Action.WARN,)


def test_a_state_poisoned_by_a_batch_is_rolled_back_and_the_batch_quarantined() -> None:
    assert plan(cause=Cause.CORRUPT_STATE, state_damaged=True, caused_by_data=True) == (
        Action.SKIP,
        Action.QUARANTINE,
        Action.ROLLBACK,
    )
    assert plan(cause=Cause.CORRUPT_STATE, state_damaged=True) == (Action.SKIP, Action.ROLLBACK)


def test_buffers_a_batch_poisoned_are_repaired_without_the_rollback_budget_and_the_drop_counts() -> None:
    kw = {"cause": Cause.CORRUPT_STATE, "state_damaged": True, "caused_by_data": True, "rollback_budget_left": 0}
    assert plan_remedy(RemedyFacts(NAN, installed=SUITE, **kw)).stop is StopReason.ROLLBACK_BUDGET  # type: ignore[arg-type]
    repair = RemedyFacts(NAN, installed=SUITE, repair_only=True, **kw)  # type: ignore[arg-type]
    p = plan_remedy(repair)
    assert p.actions == (Action.SKIP, Action.QUARANTINE, Action.ROLLBACK)
    assert p.stop is None
    assert counts_as_dropped(repair, p)  # bounded by the dropped-updates budget instead
    assert not counts_as_dropped(RemedyFacts(NAN, installed=SUITE, **kw), p)  # type: ignore[arg-type]
