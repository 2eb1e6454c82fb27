"""SnapshotRates: the rate each kept snapshot was taken at, the rate its state trained at, and a jump in the rate."""

from __future__ import annotations

import pytest

from lightning_nanguard.policies.snapshot_rates import PROVEN_STEPS, RATE_JUMP, RestoredRates, SnapshotRates


def _run(rates: SnapshotRates, schedule: list[float], snapshots: set[int], kept: int = 2) -> list[int]:
    """Observe ``schedule`` step by step, snapshotting at ``snapshots`` and before every jump; the steps snapshotted."""
    taken: list[int] = []
    for step, rate in enumerate(schedule):
        if step in snapshots or rates.jumped(rate):
            taken.append(step)
            rates.snapshot(step, rate, set(taken[-kept:]))
        rates.observe(rate)
    return taken


def test_a_constant_rate_is_proven_and_a_jump_is_snapshotted_before_its_first_step() -> None:
    rates = SnapshotRates()
    schedule = [0.075] * 60 + [0.75] * 10  # a constant rate that jumps 10x at step 60
    assert _run(rates, schedule, {0, 50}) == [0, 50, 60]
    assert rates.taken == {50: 0.075, 60: 0.75}  # the ring keeps two
    # The step-60 snapshot was taken at 0.75, a rate its state never trained at; it trained at 0.075.
    assert rates.trained == {50: 0.075, 60: 0.075}
    assert rates.at(60) == RestoredRates(taken=0.075, trained=0.075)


def test_the_start_of_a_fit_and_a_steep_warmup_prove_no_rate() -> None:
    rates = SnapshotRates()
    warmup = [0.3 * min(1.0, (s + 1) / 40) for s in range(45)]  # a linear warmup: its first step doubles the rate
    assert _run(rates, warmup, {0}) == [0]  # no jump: the first steps follow no training
    assert rates.at(0).trained is None
    assert rates.at(0).taken == pytest.approx(0.3 / 40)
    rates = SnapshotRates()
    _run(rates, warmup[:PROVEN_STEPS], {PROVEN_STEPS - 1})
    assert rates.trained == {}  # fewer than PROVEN_STEPS steps before it
    rates = SnapshotRates()
    _run(rates, [0.3 * (s + 1) / 100 for s in range(20)], {15})
    assert rates.trained == {}  # steps 5-14 ran at 0.018-0.045: they did not hold within RATE_JUMP of each other


def test_a_slow_warmup_proves_the_lowest_rate_of_the_last_steps() -> None:
    rates = SnapshotRates()
    schedule = [0.3 * (s + 1) / 500 for s in range(301)]
    _run(rates, schedule, {0, 300})
    assert rates.trained[300] == pytest.approx(schedule[300 - PROVEN_STEPS])


def test_a_restore_forgets_the_abandoned_steps_and_an_unknown_rate_proves_nothing() -> None:
    rates = SnapshotRates()
    _run(rates, [0.1] * 30, {0, 20})
    rates.restored(20)
    assert not rates.jumped(0.1 * RATE_JUMP)  # no step observed since the restore: no jump to measure from
    for _ in range(PROVEN_STEPS - 1):
        rates.observe(0.1)
    rates.observe(None)  # a tensor rate (a capturable optimizer): not read
    rates.observe(0.1)
    rates.snapshot(40, 0.1, {20, 40})
    assert 40 not in rates.trained
    rates.reset()
    assert rates.taken == rates.trained == {}


def test_a_warm_restart_is_a_jump_though_its_cosine_tail_proves_no_rate() -> None:
    # CosineAnnealingWarmRestarts(T_0=25): the rate decays steeply into each restart, then jumps back to its peak.
    import math

    schedule = [0.05 * 0.5 * (1 + math.cos(math.pi * (s % 25) / 25)) for s in range(60)]
    rates = SnapshotRates()
    assert _run(rates, schedule, {0}) == [0, 25, 50]
    assert rates.at(50).trained is None  # the tail's rates did not hold within RATE_JUMP of each other
    assert rates.at(50).taken == pytest.approx(0.05)
