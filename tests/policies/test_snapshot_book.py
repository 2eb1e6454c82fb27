"""AutoRollback's judgement of its snapshots, without a Trainer: ``SnapshotBook`` and the skips after a rollback."""

from __future__ import annotations

from lightning_nanguard.contract import StepHealth
from lightning_nanguard.policies.rollback import RollbackPolicy
from lightning_nanguard.policies.snapshot_health import History, SnapshotBook

CALM = StepHealth(grad_norm=1.0, loss=0.5)


def _readings(levels: dict[int, float], steps: int) -> History:
    """The engine's ``(step, grad_norm, loss)`` of finite steps: calm, times ``levels[step]`` where given."""
    return [(s, 1.0 * levels.get(s, 1.0), 0.5 * levels.get(s, 1.0)) for s in range(steps)]


def _take(book: SnapshotBook, kept: list[int], step: int, ring_size: int = 2) -> None:
    """What AutoRollback does at a snapshot step: the ring keeps ``book.keep``'s snapshot, evicts the oldest other."""
    keep = book.keep(kept)
    kept.append(step)
    while len(kept) > ring_size:
        kept.remove(min(s for s in kept if s != keep))
    book.taken(step, kept)


def test_a_snapshot_is_due_on_its_cadence_once_and_waits_out_the_quiet_steps() -> None:
    book = SnapshotBook(every_n_steps=5, quiet_steps=3)
    assert [s for s in range(12) if book.due(s, [])] == [0, 5, 10]
    assert not book.due(5, [5])  # taken already
    book.distrust(4)
    assert not book.due(5, [0])
    assert book.due(10, [0])
    book.distrust(2)  # an older incident does not move the last one back
    assert book.last_incident == 4


def test_a_snapshot_waits_for_its_own_steps_reading_and_is_judged_by_it() -> None:
    book = SnapshotBook(every_n_steps=10, quiet_steps=0)
    kept: list[int] = []
    _take(book, kept, 0)
    assert not book.score(1, _readings({}, 0), kept)  # step 0 not read yet (the device path reports it late)
    assert book.unscored == [0]
    assert not book.score(1, _readings({}, 1), kept)
    assert book.unscored == []
    assert book.judge.healths[0] == CALM


def test_a_snapshot_never_read_is_given_up_on_and_counts_as_sound() -> None:
    book = SnapshotBook(every_n_steps=10, quiet_steps=0)
    kept = [0]
    book.taken(0, kept)
    later = [(5, 1.0, 0.5)]  # the history moved past step 0 without a finite reading of it
    assert not book.score(6, later, kept)
    assert book.unscored == []
    assert book.judge.unsound == set()


RISING = {s: 30.0 ** (s - 5) for s in range(6, 30)}  # a divergence: growing 30x per step from step 6


def test_a_snapshot_taken_mid_divergence_is_passed_over_and_kept_out_of_the_ring() -> None:
    book = SnapshotBook(every_n_steps=10, quiet_steps=0)
    kept: list[int] = []
    _take(book, kept, 0)
    book.score(1, _readings(RISING, 1), kept)
    _take(book, kept, 10)
    diverging = book.score(11, _readings(RISING, 11), kept)
    assert diverging  # the steps up to it passed the factor and kept growing
    assert book.reported is not None
    assert book.reported.step == 10
    assert book.watch is None  # decided
    assert book.judge.unsound == {10}
    assert book.keep(kept) == 0  # the ring must not evict the last sound snapshot for the unsound one
    _take(book, kept, 20)
    assert kept == [0, 20]  # 10 was evicted, 0 kept


def test_one_odd_batch_at_the_snapshot_is_not_a_divergence_to_act_on() -> None:
    book = SnapshotBook(every_n_steps=10, quiet_steps=0)
    kept: list[int] = []
    _take(book, kept, 0)
    book.score(1, _readings({}, 1), kept)
    _take(book, kept, 10)
    assert not book.score(11, _readings({10: 1000.0}, 11), kept)  # a suspect, passed over by a restore meanwhile
    assert book.judge.unsound == {10}
    assert book.busy  # its trend is followed at each batch start
    for now in range(12, 15):
        assert not book.score(now, _readings({10: 1000.0}, now), kept)
        assert book.judge.unsound == {10}
    assert not book.score(15, _readings({10: 1000.0}, 15), kept)  # five readings from it on, none far up
    assert book.judge.unsound == set()  # sound after all
    assert not book.busy


def test_a_jump_that_falls_or_holds_is_never_acted_on_and_its_snapshot_is_sound_once_it_falls() -> None:
    # A new data domain at step 7: the loss and grad norm 100x, holding until step 14, then falling back.
    jump = {**dict.fromkeys(range(7, 15), 100.0), **{s: 100.0 / 3 ** (s - 14) for s in range(15, 30)}}
    book = SnapshotBook(every_n_steps=10, quiet_steps=0)
    kept: list[int] = []
    _take(book, kept, 0)
    book.score(1, _readings(jump, 1), kept)
    _take(book, kept, 10)
    verdicts = {now: book.score(now, _readings(jump, now), kept) for now in range(11, 20) if book.busy}
    assert not any(verdicts.values())
    assert max(verdicts) == 18  # turned: the median of steps 13-17 fell below half its peak
    assert book.judge.unsound == set()
    assert book.judge.reference == CALM  # the top of a jump is no yardstick for the next snapshot
    _take(book, kept, 20)
    assert not book.score(21, _readings(jump, 21), kept)
    assert not book.busy  # the step-20 snapshot is sound: nothing to follow


def test_settle_answers_a_pending_divergence_and_a_restore_forgets_the_abandoned_trajectory() -> None:
    book = SnapshotBook(every_n_steps=10, quiet_steps=5)
    kept: list[int] = []
    _take(book, kept, 0)
    book.score(1, _readings(RISING, 1), kept)
    _take(book, kept, 10)
    book.diverging = book.score(11, _readings(RISING, 11), kept)
    assert book.diverging
    book.settle(18, _readings(RISING, 18), kept)
    assert not book.diverging  # the restore answers it: it passes over the snapshot judged so
    assert book.judge.unsound == {10}
    book.restored(18, 0)
    assert book.judge.unsound == set()  # verdicts after step 0 belong to the abandoned trajectory
    assert book.last_incident == 18  # the rollback itself: the next snapshot waits out the quiet steps
    assert not book.due(20, [0])
    assert book.due(30, [0])


def test_batches_after_a_rollback_are_skipped_counted_and_kept_across_a_resume() -> None:
    policy = RollbackPolicy(max_rollbacks=3, window=100, recurrence_steps=0, skip_batches=2)
    assert not policy.skip_batch()
    policy.record(10, 5)
    assert [policy.skip_batch() for _ in range(3)] == [True, True, False]
    policy.record(20, 15)
    assert policy.skip_batch()
    assert policy.budget_left_at(20) == 1
    assert policy.budget_left_at(115) == 2  # step 10 left the window
    resumed = RollbackPolicy(max_rollbacks=3, window=100, recurrence_steps=0, skip_batches=2)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.state_dict() == policy.state_dict()
    assert (resumed.skipped_batches, resumed.skip_left, resumed.total) == (3, 1, 2)
    older = RollbackPolicy()
    older.load_state_dict({"rollbacks": 1})  # a state without the newer keys
    assert (older.total, older.history, older.last_restored_step, older.skip_left) == (1, [], None, 0)


def test_after_a_rollback_the_trend_reads_only_the_trajectory_that_goes_on() -> None:
    # A divergence at step 6 is rolled back at step 12 to the step-0 snapshot; the run then goes on at a level 100x
    # the old one (a new domain) and holds. The readings of steps 6-12 (the abandoned trajectory, far higher) must
    # neither make the new level look turned nor be taken for growth.
    book = SnapshotBook(every_n_steps=10, quiet_steps=0)
    kept: list[int] = []
    _take(book, kept, 0)
    book.score(1, _readings(RISING, 1), kept)
    _take(book, kept, 10)
    assert book.score(11, _readings(RISING, 11), kept)
    book.restored(12, 0)
    kept.remove(10)
    level = {**RISING, **dict.fromkeys(range(12, 40), 100.0)}
    _take(book, kept, 20)
    assert not book.score(21, _readings(level, 21), kept)
    assert book.watch is not None
    assert book.watch.since == 12
    for now in range(22, 30):
        assert not book.score(now, _readings(level, now), kept)
        assert book.judge.unsound == {20}  # a suspect while the level holds: neither turned nor growing
    grows = {**level, **{s: 100.0 * 3 ** (s - 29) for s in range(30, 40)}}
    assert any(book.score(now, _readings(grows, now), kept) for now in range(30, 40))  # then it grows: diverging
