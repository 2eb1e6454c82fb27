"""The pure rollback policy: snapshot cadence, snapshot choice, recurrence and the windowed budget."""

from __future__ import annotations

from lightning_nanguard.policies.rollback import RollbackPolicy, snapshot_due


def test_snapshot_due_on_cadence_once_and_only_after_a_quiet_period() -> None:
    due = [
        s
        for s in range(12)
        if snapshot_due(s, every_n_steps=3, last_snapshot_step=None, last_incident_step=None, quiet_steps=2)
    ]
    assert due == [0, 3, 6, 9]
    assert not snapshot_due(6, every_n_steps=3, last_snapshot_step=6, last_incident_step=None, quiet_steps=2)
    assert not snapshot_due(6, every_n_steps=3, last_snapshot_step=3, last_incident_step=4, quiet_steps=2)
    assert snapshot_due(6, every_n_steps=3, last_snapshot_step=3, last_incident_step=3, quiet_steps=2)


def test_newest_snapshot_first_then_older_on_recurrence() -> None:
    policy = RollbackPolicy(max_rollbacks=5, window=100, recurrence_steps=10)
    first = policy.decide(40)
    assert not first.recurrence
    assert policy.choose(first, [10, 20, 30]) == 30
    policy.record(40, 30)
    again = policy.decide(45)
    assert again.recurrence
    assert policy.choose(again, [10, 20, 30]) == 20
    policy.record(45, 20)
    assert policy.choose(policy.decide(50), [20]) is None  # nothing older in memory: the caller goes to disk
    assert not policy.decide(70).recurrence


def test_budget_counts_rollbacks_within_the_window_only() -> None:
    policy = RollbackPolicy(max_rollbacks=2, window=100, recurrence_steps=0)
    for step in (10, 20):
        assert not policy.decide(step).exhausted
        policy.record(step, step - 5)
    third = policy.decide(30)
    assert third.exhausted
    assert third.in_window == 3
    assert not policy.decide(115).exhausted  # step 10 left the window
    assert policy.total == 2
    assert policy.budget_left == 0
