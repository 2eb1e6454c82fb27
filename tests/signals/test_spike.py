from __future__ import annotations

import math

import torch

from lightning_nanguard.signals.spike import NEW_LEVEL_AFTER, RunningZScore


def _feed(z: RunningZScore, values: list[float]) -> list[bool]:
    return [bool(z.observe(torch.tensor(v))) for v in values]


def test_no_spike_during_warmup_or_on_steady_values() -> None:
    z = RunningZScore(threshold=6.0, warmup=5)
    assert _feed(z, [1000.0] + [1.0] * 4) == [False] * 5  # warmup: nothing is tested yet
    assert not any(_feed(z, [1.0 + 0.01 * (i % 3) for i in range(30)]))


def test_tenfold_jump_after_warmup_is_a_spike_and_does_not_move_the_stats() -> None:
    z = RunningZScore(threshold=6.0, warmup=10)
    _feed(z, [2.0 * (1 + 0.02 * math.sin(i)) for i in range(20)])
    mean, count = float(z.mean), int(z.count)
    assert _feed(z, [20.0]) == [True]
    assert float(z.last_z) > 6.0
    assert (float(z.mean), int(z.count)) == (mean, count)


def test_decreasing_values_and_nonfinite_values_are_not_spikes() -> None:
    z = RunningZScore(threshold=6.0, warmup=3)
    assert not any(_feed(z, [10.0 / (i + 1) for i in range(20)]))
    count = int(z.count)
    assert _feed(z, [math.nan, math.inf]) == [False, False]  # non-finite is the non-finite check's business
    assert int(z.count) == count


def test_state_round_trip() -> None:
    a = RunningZScore(threshold=6.0, warmup=3)
    _feed(a, [1.0, 2.0, 3.0])
    b = RunningZScore(threshold=6.0, warmup=3)
    b.load(a.state())
    assert b.state() == a.state()


def test_a_level_that_holds_is_the_new_normal_after_a_few_spikes_in_a_row() -> None:
    # A new data domain lifts the loss 20x for good: the first NEW_LEVEL_AFTER - 1 steps are spikes, then the level
    # is the new normal (not every later step a spike, each update dropped, for the rest of the run).
    z = RunningZScore(threshold=6.0, warmup=10)
    calm = [2.0 * (1 + 0.02 * math.sin(i)) for i in range(20)]
    _feed(z, calm)
    high = [40.0 * (1 + 0.02 * math.sin(i)) for i in range(30)]
    assert _feed(z, high) == [True] * (NEW_LEVEL_AFTER - 1) + [False] * (30 - NEW_LEVEL_AFTER + 1)
    assert _feed(z, [400.0]) == [True]  # a spike above the new level is still one


def test_spikes_that_do_not_hold_never_become_the_normal() -> None:
    z = RunningZScore(threshold=6.0, warmup=10)
    _feed(z, [2.0 * (1 + 0.02 * math.sin(i)) for i in range(20)])
    burst = [20.0] * (NEW_LEVEL_AFTER - 1) + [2.0]
    for _ in range(3):
        assert _feed(z, burst) == [True] * (NEW_LEVEL_AFTER - 1) + [False]
