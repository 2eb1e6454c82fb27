from __future__ import annotations

import pytest

from lightning_nanguard.policies.skip import SkipBudget
from lightning_nanguard.policies.verdict import Action

N, B = False, True


@pytest.mark.parametrize(
    ("mode", "budget", "steps", "expected"),
    [
        ("skip", 2, [N, B, B, N, B, B, B], ["none", "skip", "skip", "none", "skip", "skip", "stop"]),
        ("skip", 0, [B], ["stop"]),
        ("warn", 1, [B, N, B, B], ["warn", "none", "warn", "stop"]),
        ("stop", 5, [N, B], ["none", "stop"]),
    ],
    ids=["skip-streak", "zero-budget", "warn", "stop"],
)
def test_decisions(mode: str, budget: int, steps: list[bool], expected: list[str]) -> None:
    policy = SkipBudget(mode, budget)  # type: ignore[arg-type]
    assert [policy.decide(bad, scaler_skips=False).value for bad in steps] == expected


def test_scaler_skips_are_counted_not_acted_on_and_still_budgeted() -> None:
    policy = SkipBudget("skip", 2)
    got = [policy.decide(True, scaler_skips=True) for _ in range(3)]
    assert got == [Action.SCALER_SKIP, Action.SCALER_SKIP, Action.STOP]
    assert policy.total_bad == 3
    assert policy.budget_left == 0
