"""The remedy ladder (policies/remedy.py): facts in, a Plan out. The suite must not over-react."""

from __future__ import annotations

import pytest

from lightning_nanguard.contract import Action, Cause, Signal
from lightning_nanguard.policies.remedy import Installed, RemedyFacts, plan_remedy

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
        assert p.actions == (Action.SKIP, Action.ROLLBACK, Action.BACKOFF)
        assert not p.stop
    else:
        assert p.stop
        assert "4 dropped updates in a row, more than max_consecutive_skips=3" in p.reason


def test_skips_not_caused_by_the_data_back_off_once_enough_recur() -> None:
    assert plan(recent_skips=2) == (Action.SKIP,)
    assert plan(recent_skips=3) == (Action.SKIP, Action.BACKOFF)
    assert plan(cause=Cause.INPUT_DATA, recent_skips=3) == (Action.SKIP, Action.QUARANTINE)


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
