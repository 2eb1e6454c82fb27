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


def test_early_in_a_fit_a_probe_back_at_its_untrained_level_is_a_rise_against_its_recent_past() -> None:
    # The only snapshot is the untrained model (4.3); a spike at step 10 was held with the probe at 2.3. At step 39
    # the probe is back at 4.34: not 2x the snapshot's (the untrained level cannot be doubled), but it undid all that
    # the probe had learned by step 10: a rise, and every snapshot since the held spike is suspect.
    book = _book({0: 4.3})
    assert not book.judge(10, 2.3, kept=[0], batch_loss=2.6).rose  # held: kept as the recent past
    assert book.recent.best(39) == (10, 2.3)
    assert not book.judge(36, 3.25, kept=[0], batch_loss=2.6).rose  # half way back: not yet
    verdict = book.judge(39, 4.34, kept=[0], batch_loss=3.1, reference_now=4.3)
    assert verdict.rose
    assert verdict.recent == 2.3
    assert "its recent level 2.3" in verdict.summary()
    assert not book.judge(90, 4.34, kept=[0], batch_loss=3.1).rose  # the held spike is 80 steps back: no yardstick
    book.restored(0)
    assert book.recent.scores == {}  # the abandoned trajectory's scores are forgotten


def test_the_recent_yardstick_follows_a_change_of_the_objective() -> None:
    # A stage switch since: the reference snapshot's weights lose 30x more now than when it was taken, so the probe's
    # recent level (0.2 under the old objective) counts as 6.0: 5.0 is no loss of what was learned.
    book = _book({0: 4.0, 50: 0.3})
    book.judge(60, 0.2, kept=[0, 50], batch_loss=0.25)
    assert not book.judge(70, 5.0, kept=[0, 50], batch_loss=6.0, reference_now=9.0).rose
