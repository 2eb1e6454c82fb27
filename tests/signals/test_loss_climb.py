"""A loss that climbs and stays up is flagged once, on the host floats the step reads anyway; a hard batch is not."""

from __future__ import annotations

from lightning_nanguard.signals.loss_climb import CLIMB_SPAN, ClimbingLoss


def _feed(detector: ClimbingLoss, values: list[float]) -> list[int]:
    return [i for i, v in enumerate(values) if detector.observe(v) and detector.climbed]


def test_a_climb_that_stays_up_is_flagged_once_and_a_hard_batch_is_not() -> None:
    detector = ClimbingLoss(threshold=1e9, warmup=10)  # the z-score never fires: only the climb does
    level = [1.0 + 0.1 * (i % 3) for i in range(40)]
    assert _feed(detector, [*level[:20], 5.0, *level[20:]]) == []  # one hard batch: the median does not move
    climbed = _feed(detector, [3.0] * 20)
    assert climbed == [CLIMB_SPAN // 2]  # three of five steps up, and not again while it stays up


def test_a_restore_starts_the_climb_over() -> None:
    detector = ClimbingLoss(threshold=1e9, warmup=5)
    _feed(detector, [0.1] * 30)
    detector.restart()  # an older state restored: its higher loss is no climb over the abandoned level
    assert _feed(detector, [1.0] * 10) == []
