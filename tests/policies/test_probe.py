"""The probe's judgement (pure): a spike whose probe loss rose with it, against the newest sound snapshot."""

from __future__ import annotations

import math

from lightning_nanguard.policies.probe import LOST, ProbeBook
from lightning_nanguard.signals.loss_climb import LossTrend


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


def test_a_probe_that_gave_back_what_it_learned_lately_is_a_rise_where_the_training_loss_did_too() -> None:
    # The newest sound snapshot is the untrained model (4.3); the probe came down to 2.3 at a spike it held; at step 40
    # it is back at 4.36, under 2x the untrained level, having given back everything it learned since.
    book = _book({0: 4.3})
    assert not book.judge(12, 2.3, kept=[0], batch_loss=2.2, trend=LossTrend(0.0)).rose  # held: kept as a recent score
    verdict = book.judge(40, 4.36, kept=[0], batch_loss=4.7, trend=LossTrend(0.51))
    assert verdict.rose
    assert verdict.by_recent
    assert (verdict.lately, verdict.lately_step) == (2.3, 12)
    assert verdict.lost is not None
    assert verdict.lost > 1.0
    assert "given back" in verdict.summary()
    assert verdict.values()["probe_by_recent"] is True


def test_against_the_recent_past_the_training_loss_must_agree() -> None:
    # The few rows of a probe wobble back past their untrained loss at the edge of stability while the training loss
    # holds (a median of five steps): no rise. Nor without the training loss's figure at all. A third is enough
    # where it agrees.
    book = _book({0: 0.27})
    book.judge(10, 0.02, kept=[0], batch_loss=0.02, trend=LossTrend(0.0))
    assert not book.judge(14, 0.34, kept=[0], batch_loss=0.3, trend=LossTrend(0.08)).rose
    assert not book.judge(15, 0.34, kept=[0], batch_loss=0.3).rose
    assert book.judge(16, 0.11, kept=[0], batch_loss=0.1, trend=LossTrend(0.6)).rose


def test_the_recent_past_is_recent_and_of_this_trajectory() -> None:
    book = _book({0: 4.0})
    book.judge(10, 1.0, kept=[0], batch_loss=1.0, trend=LossTrend(0.0))
    assert not book.judge(80, 3.5, kept=[0], batch_loss=3.5, trend=LossTrend(0.9)).rose  # 70 steps back: not recent
    book = _book({0: 4.0})
    book.judge(10, 1.0, kept=[0], batch_loss=1.0, trend=LossTrend(0.0))
    book.restored(0)  # the held spike belonged to the abandoned trajectory
    assert not book.judge(20, 3.5, kept=[0], batch_loss=3.5, trend=LossTrend(0.9)).rose


def test_against_the_recent_past_the_objective_s_own_change_is_scaled_out() -> None:
    # A curriculum stage doubled the loss since the snapshot: its weights score 2x now what they scored then, and
    # the probe's recent level moves with them; the current weights at that level are no rise.
    book = _book({0: 4.0, 50: 1.0})
    book.judge(60, 1.0, kept=[0, 50], batch_loss=1.0, reference_now=1.0, trend=LossTrend(0.0))
    verdict = book.judge(70, 2.2, kept=[0, 50], batch_loss=2.2, reference_now=2.0, trend=LossTrend(0.6))
    assert not verdict.rose
    assert verdict.lately == 2.0


def test_a_held_spike_is_kept_against_the_reference_at_its_moment_so_an_easier_objective_is_no_rise() -> None:
    # A loss weight ramped down halves the objective after the snapshot of step 50 (its weights score 1.0 at step 60,
    # not 2.0): the spike held at step 60 is kept as the ratio of the two scores of that moment, 1.0. At step 70 the
    # probe is 1.1x the reference's weights: it gave back a tenth of what it had learned, whatever the objective did
    # since (scaling its score by the reference's change since the snapshot would call that 40%, a rise).
    book = _book({0: 4.0, 50: 2.0})
    book.judge(60, 1.0, kept=[0, 50], batch_loss=1.0, reference_now=1.0, trend=LossTrend(0.0))
    verdict = book.judge(70, 1.1, kept=[0, 50], batch_loss=1.1, reference_now=1.0, trend=LossTrend(0.6, level=1.1))
    assert not verdict.rose
    assert verdict.lost is not None
    assert verdict.lost < LOST


def test_a_climb_probed_alone_is_judged_against_the_recent_past_only() -> None:
    # 12 steps after a domain switch the old-domain probe is forgotten far past the new domain's batches: at a spike
    # that would be a rise against the snapshot; a climb of the loss probed alone is not judged that way.
    book = _book({0: 0.73, 50: 0.0008})
    assert book.judge(109, 6.4, kept=[0, 50], batch_loss=0.94).rose
    assert not book.judge(
        109, 6.4, kept=[0, 50], batch_loss=0.94, trend=LossTrend(7.7, level=2.1, climb_only=True)
    ).rose


def test_a_forgotten_old_domain_probe_far_above_the_training_loss_is_no_rise_against_the_recent_past() -> None:
    # 27 steps after a switch the old-domain probe (3.06) loses 6x what the run's new-domain batches do lately (0.5):
    # the rows are no longer like the data; a divergence makes both lose alike. (A climb probed alone.)
    book = _book({0: 0.73, 50: 0.0008})
    book.judge(97, 0.024, kept=[0, 50], batch_loss=5.7, trend=LossTrend(0.0))
    assert not book.judge(
        136, 3.06, kept=[0, 50], batch_loss=2.0, trend=LossTrend(0.7, level=0.5, climb_only=True)
    ).rose
    assert book.judge(136, 3.06, kept=[0, 50], batch_loss=2.0, trend=LossTrend(0.7, level=2.5, climb_only=True)).rose
