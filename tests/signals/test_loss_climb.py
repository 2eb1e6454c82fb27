"""A loss that gives back half of what the run had learned, and stays there, is flagged once, on the host floats the
step reads anyway; a hard batch, a run that has not learned, and a restored older state are not."""

from __future__ import annotations

import pytest

from lightning_nanguard.signals.loss_climb import CLIMB_AGAIN, CLIMB_SPAN, CLIMB_WINDOW, ClimbingLoss, LossProgress


def _climbs(detector: ClimbingLoss, values: list[float]) -> list[int]:
    return [i for i, v in enumerate(values) if detector.observe(v) and detector.climbed]


def test_a_climb_that_stays_up_is_flagged_once_and_a_hard_batch_is_not() -> None:
    detector = ClimbingLoss(threshold=1e9, warmup=10)  # the z-score never fires: only the climb does
    learned = [4.0] * 5 + [4.0 - 0.1 * i for i in range(25)] + [1.5] * 10  # 4.0 down to 1.5
    assert _climbs(detector, [*learned, 6.0, 1.5, 1.5, 6.0, *[1.5] * 10]) == []  # hard batches: the median holds
    climbed = _climbs(detector, [3.5] * 25)  # back 80% of the way to the start, and staying there
    # Three of five steps up, then again every CLIMB_AGAIN steps while it stays up (the probe looks again).
    assert climbed == [CLIMB_SPAN // 2, CLIMB_SPAN // 2 + CLIMB_AGAIN, CLIMB_SPAN // 2 + 2 * CLIMB_AGAIN]


def test_a_new_level_stops_being_flagged_once_the_recent_low_is_out_of_the_window() -> None:
    detector = ClimbingLoss(threshold=1e9, warmup=10)
    _climbs(detector, [4.0] * 5 + [1.0] * 30)
    climbed = _climbs(detector, [3.0] * 200)  # a new domain the run settles at
    assert len(climbed) <= CLIMB_WINDOW // CLIMB_AGAIN + 1
    assert max(climbed) < CLIMB_WINDOW + CLIMB_SPAN


def test_a_run_that_has_not_learned_has_nothing_to_give_back() -> None:
    progress = LossProgress()
    for v in [4.0] * 5 + [3.6] * 20 + [4.0] * 5:
        progress.observe(v)
    assert progress.lost() is None  # came down 10% of its start: noise, not progress


def test_a_restore_starts_the_recent_levels_over() -> None:
    detector = ClimbingLoss(threshold=1e9, warmup=5)
    _climbs(detector, [4.0] * 5 + [1.0] * 30)
    detector.restart()  # an older state restored: its higher loss is no climb over the abandoned level
    assert _climbs(detector, [3.0] * 10) == []
    assert detector.progress.start == 4.0


def test_the_progress_round_trips_and_a_malformed_one_is_refused() -> None:
    progress = LossProgress()
    for v in [4.0, 3.9, 4.1, 3.0, 2.5, 2.0, 1.5]:
        progress.observe(v)
    copy = LossProgress()
    copy.load_state_dict(progress.state_dict())
    assert copy.state_dict() == progress.state_dict()
    assert (copy.start, copy.level, copy.lost()) == (progress.start, progress.level, progress.lost())
    for bad in ([1.0], {"medians": [1.0, "x"]}, {"start": [1.0, 2.0]}, {"last": [float("nan")]}):
        with pytest.raises(ValueError, match="progress"):
            LossProgress().load_state_dict(bad)
