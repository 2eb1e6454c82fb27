"""The probe's judgement (pure): a spike whose probe loss rose with it, against the newest sound snapshot."""

from __future__ import annotations

import math

from lightning_nanguard.policies.probe import ProbeBook


def _book(scores: dict[int, float]) -> ProbeBook:
    book = ProbeBook()
    for step, loss in scores.items():
        book.record(step, loss)
    return book


def test_a_probe_that_rose_with_the_spike_is_a_rise_against_the_newest_sound_snapshot() -> None:
    book = _book({0: 0.7, 50: 0.05, 100: 0.04})
    verdict = book.judge(120, 0.5, kept=[50, 100], batch_loss=0.6)
    assert verdict.rose
    assert (verdict.before_step, verdict.before, verdict.after, verdict.unsound) == (100, 0.04, 0.5, ())
    assert "0.04 at the snapshot of step 100 -> 0.5 at step 120" in verdict.summary()


def test_a_probe_that_held_is_no_rise_whatever_the_batch_did() -> None:
    book = _book({0: 0.7, 50: 0.05})
    assert not book.judge(60, 0.06, kept=[0, 50], batch_loss=500.0).rose  # a hard batch: the probe did not move


def test_a_snapshot_taken_during_the_climb_is_passed_over() -> None:
    # The step-100 snapshot's probe loss is already 4x the step-50 one's: taken during the climb, not sound.
    book = _book({0: 0.7, 50: 0.05, 100: 0.2})
    verdict = book.judge(110, 1.5, kept=[50, 100], batch_loss=1.2)
    assert verdict.rose
    assert verdict.before_step == 50
    assert verdict.unsound == (100,)


def test_near_zero_a_ratio_alone_is_no_rise() -> None:
    # 1e-3 -> 4e-3 is 4x, but far below 5% of the probe's untrained loss: an ordinary wobble of a solved task.
    book = _book({0: 0.2, 100: 0.001})
    assert not book.judge(120, 0.004, kept=[0, 100], batch_loss=0.005).rose
    assert book.judge(120, 0.05, kept=[0, 100], batch_loss=0.05).rose


def test_a_probe_far_below_the_spiking_batch_is_a_new_domain_not_a_divergence() -> None:
    # After a domain switch the old-domain probe loses 10x more, while the new domain's batch loses 20x more still.
    book = _book({0: 0.07, 50: 0.0013})
    assert not book.judge(98, 0.014, kept=[0, 50], batch_loss=0.27).rose
    assert book.judge(98, 0.2, kept=[0, 50], batch_loss=0.27).rose


def test_a_non_finite_probe_is_a_rise_and_no_snapshot_scored_is_none() -> None:
    assert _book({0: 0.5}).judge(10, math.inf, kept=[0], batch_loss=1.0).rose
    verdict = _book({}).judge(10, 5.0, kept=[0], batch_loss=1.0)
    assert not verdict.rose
    assert verdict.before_step is None


def test_a_restore_forgets_the_abandoned_trajectory() -> None:
    book = _book({0: 0.7, 50: 0.05, 100: 0.3})
    book.restored(50)
    assert book.scores == {0: 0.7, 50: 0.05}


def test_the_reference_scored_now_is_the_yardstick_like_with_like() -> None:
    # A curriculum stage made the objective harder since the snapshot: scored now, under the same objective, the
    # snapshot's weights lose 3.0 and the current ones 2.5: no rise, although 2.5 is 50x the snapshot's old score.
    book = _book({0: 0.7, 50: 0.05})
    assert book.reference([0, 50]) == 50
    verdict = book.judge(60, 2.5, kept=[0, 50], batch_loss=3.0, reference_now=3.0)
    assert not verdict.rose
    assert verdict.same_moment
    assert (verdict.before, verdict.before_step) == (3.0, 50)
    assert "under the weights of the snapshot of step 50, 2.5 under the current weights" in verdict.summary()
    assert book.judge(60, 2.5, kept=[0, 50], batch_loss=3.0, reference_now=0.9).rose  # the weights did get worse
    assert book.judge(60, 2.5, kept=[0, 50], batch_loss=3.0).rose  # not scored now: its old score stands in
