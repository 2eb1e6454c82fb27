"""Did the weights get worse? The probe batch's scores at each snapshot, judged against its score at a spike. Pure.

A spike (the loss or gradient norm far above its recent window) says the batch looked unusual; it cannot say
whether the weights are going wrong (a learning rate past the stability edge) or the batch is just hard or new (a
data domain switch, heavy-tailed valid samples). The probe can: a fixed handful of training samples, scored with the
weights of each snapshot when it is taken and with the current weights at a spike (``recovery.probe``). A probe loss
that rose with the spike means the weights got worse on data they had learned; one that did not means the batch was
the unusual thing and there is nothing to do.

The yardstick is the newest *sound* snapshot: a snapshot whose probe loss had risen more than ``factor`` x the lowest
one before it was taken during a climb and is not sound (a rollback passes over it). At a spike the probe's loss is
compared with that snapshot's: more than ``factor`` x is a rise (``ProbeVerdict.rose``), provided it also rose by
more than ``floor`` x the probe's loss at the fit's first snapshot (its untrained level): near a loss of zero a
ratio alone is noise (a probe at 1e-3 of its start moving to 4e-3 is an ordinary wobble, not a divergence).

A rise alone does not make the weights wrong either: after a switch to a new data domain, one update can make a
probe drawn from the old domain lose 10x more while the weights are doing exactly what they should. What tells them
apart is the spiking batch itself: when the weights are going wrong, the probe (ordinary training samples) does about
as badly as the batch (``after >= of_batch`` x the batch's loss); when the batch is the unusual thing, the probe stays
far below it. Both must hold.

Early in a fit the newest sound snapshot is the untrained model, and weights that gave back everything they learned
since only score as badly as it does, never twice as badly (a language model whose attention runs away returns to a
near-uniform prediction: the untrained loss). The second yardstick is the recent past: the probe's lowest score at
the spikes it held in the last ``RECENT`` steps, or the reference snapshot's own. Each held score is kept as a ratio to
the reference's weights scored at the same moment, so a change of the objective since (a curriculum stage, a ramped
weight) changes both sides of every comparison alike. A probe that gave back ``LOST`` (a third) of what it had learned
by then, back that share of the way to its loss at the first snapshot, is a rise too, where the training loss itself
gave back half of its own (``signals.loss_climb``: the median of five steps, so a wobble of the probe's few rows on a
noisy healthy fit is not enough), and the probe is neither far below the batch nor far above the training loss's level
(``of_batch`` each way: a probe from an old data domain, forgotten after a switch, loses far more than the new
domain's batches; a divergence makes both lose alike).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from lightning_nanguard.signals.loss_climb import CLIMB_LOST, CLIMB_WINDOW, LossTrend, given_back

__all__ = ["LOST", "PROBE_OF_BATCH", "PROBE_ROSE_FACTOR", "PROBE_ROSE_FLOOR", "RECENT", "ProbeBook", "ProbeVerdict"]

# A rise of the probe's loss this large (a ratio) is the weights going wrong: one update on a hard or new batch moves
# the probe's loss by a few percent; a divergence multiplies it.
PROBE_ROSE_FACTOR = 2.0
# ... and by at least this share of the probe's loss at the first snapshot (the scale of the task's loss).
PROBE_ROSE_FLOOR = 0.05
# ... and the probe doing at least this share as badly as the spiking batch (a new domain's batch loses far more).
PROBE_OF_BATCH = 0.5
# Against the recent past: the share of what the probe had learned that, given back, is a rise, where the training
# loss gave back ``CLIMB_LOST`` of its own (a median of five steps: the stronger evidence; the probe says the weights,
# not the data or the objective, did it, and its few rows lag or lead the batches by a few steps) ...
LOST = 1 / 3
# ... over the probe's scores of this many steps back (the preset's snapshot cadence).
RECENT = CLIMB_WINDOW


@dataclass(frozen=True)
class ProbeVerdict:
    """The probe re-scored at a spike of ``step``, against the newest sound snapshot.

    Attributes:
        step: the spike's step.
        before: the probe's loss under the reference snapshot's weights (NaN: no snapshot was scored).
        before_step: that snapshot's step (``None``: none).
        after: the probe's loss under the current weights.
        batch_loss: the spiking batch's loss (``None``: not known).
        rose: ``after`` rose over ``before`` (``ProbeBook.rise``) and is not far below ``batch_loss``: the weights
            got worse.
        unsound: the snapshots taken after the climb began (their probe loss had already risen), newest first.
        factor: the ratio that counts as a rise.
        same_moment: ``before`` is the reference snapshot's weights scored at the spike, beside ``after`` (False:
            its score when it was taken).
        lately: the probe's lowest score of the recent past, as the weights of that moment would score now (its ratio
            to the reference's weights then, times ``before``; ``None``: none), and ``lately_step`` its step.
        lost: the share of what the probe had learned by ``lately`` that ``after`` gave back (``None``: it had not
            learned enough to say), and ``loss_lost`` the training loss's (``signals.loss_climb``).
        by_recent: the rise is against the recent past, not the reference snapshot.
        climb_only: the step was probed for a climb of the training loss alone, not a spike.
    """

    step: int
    before: float
    before_step: int | None
    after: float
    batch_loss: float | None
    rose: bool
    unsound: tuple[int, ...] = ()
    factor: float = PROBE_ROSE_FACTOR
    same_moment: bool = False
    lately: float | None = None
    lately_step: int | None = None
    lost: float | None = None
    loss_lost: float | None = None
    by_recent: bool = False
    climb_only: bool = False

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before > 0 else math.inf

    def summary(self) -> str:
        """``"probe loss 0.0213 at the snapshot of step 100 -> 0.87 at step 131 (40.8x; the batch's loss 1.2)"``."""
        batch = "" if self.batch_loss is None else f"; the spiking batch's loss {self.batch_loss:.3g}"
        if self.lately is not None and self.lost is not None:
            batch += (
                f"; {self.lost:.0%} of what the probe had learned by step {self.lately_step} ({self.lately:.3g}) given "
                "back"
            )
            if self.loss_lost is not None:
                batch += f", {self.loss_lost:.0%} of the training loss's"
        if self.climb_only:
            batch += "; probed for the training loss's climb"
        if self.before_step is None:
            return f"probe loss {self.after:.3g} at step {self.step}, no snapshot scored to compare with{batch}"
        if self.same_moment:
            return (
                f"probe loss {self.before:.3g} under the weights of the snapshot of step {self.before_step}, "
                f"{self.after:.3g} under the current weights, both at step {self.step} ({self.ratio:.3g}x{batch})"
            )
        return (
            f"probe loss {self.before:.3g} at the snapshot of step {self.before_step} -> {self.after:.3g} at step "
            f"{self.step} ({self.ratio:.3g}x{batch})"
        )

    def values(self) -> dict[str, object]:
        return {
            "probe_before": self.before,
            "probe_before_step": self.before_step,
            "probe_after": self.after,
            "probe_ratio": self.ratio,
            "probe_same_moment": self.same_moment,
            "probe_lately": self.lately,
            "probe_lately_step": self.lately_step,
            "probe_lost": self.lost,
            "loss_lost": self.loss_lost,
            "probe_by_recent": self.by_recent,
            "probed_for": "loss_climb" if self.climb_only else "spike",
            "batch_loss": self.batch_loss,
            "unsound_snapshots": list(self.unsound),
        }


@dataclass
class ProbeBook:
    """The probe's loss at each snapshot of this fit's trajectory (a rollback forgets the abandoned ones).

    Args:
        factor: the ratio of probe losses that counts as a rise.
        floor: the least rise that counts, as a share of the probe's loss at the first snapshot.
        of_batch: the least share of the spiking batch's loss the probe must reach.
    """

    factor: float = PROBE_ROSE_FACTOR
    floor: float = PROBE_ROSE_FLOOR
    of_batch: float = PROBE_OF_BATCH
    scores: dict[int, float] = field(default_factory=dict)  # snapshot step -> probe loss
    first: float | None = None  # the probe's loss at the first snapshot scored (its untrained level)
    # The spikes the probe held lately: step -> (the reference snapshot's step, the probe's loss over the reference's
    # weights' loss at that moment).
    held: dict[int, tuple[int, float]] = field(default_factory=dict)

    def reset(self) -> None:
        self.scores.clear()
        self.held.clear()
        self.first = None

    def record(self, step: int, loss: float) -> None:
        """The snapshot of ``step`` was taken; the probe's loss under its weights."""
        if math.isfinite(loss):
            self.scores[step] = loss
            if self.first is None:
                self.first = loss

    def rise(self, now: float, before: float) -> bool:
        """``now`` is a rise over ``before``: non-finite, or more than ``factor`` x and by more than the floor."""
        if not math.isfinite(now):
            return True
        return now > self.factor * before and now - before > self.floor * (self.first or 0.0)

    def risen(self, step: int) -> bool:
        """The snapshot of ``step`` was taken during a climb: its probe loss rose over the lowest of the snapshots
        before it."""
        loss = self.scores.get(step)
        earlier = [v for s, v in self.scores.items() if s < step]
        return loss is not None and bool(earlier) and self.rise(loss, min(earlier))

    def reference(self, kept: Collection[int]) -> int | None:
        """The newest sound snapshot among ``kept`` that was scored (``None``: none): the verdict's yardstick."""
        scored = sorted((s for s in kept if s in self.scores), reverse=True)
        return next((s for s in scored if not self.risen(s)), None)

    def judge(
        self,
        step: int,
        now: float,
        kept: Collection[int],
        batch_loss: float | None = None,
        reference_now: float | None = None,
        trend: LossTrend | None = None,
    ) -> ProbeVerdict:
        """The probe's loss ``now`` at a spike of ``step`` (whose batch lost ``batch_loss``), against the newest
        sound snapshot among ``kept`` (the snapshots a rollback can restore). ``reference_now``: that snapshot's
        weights scored now, on the same rows under the same objective (like with like: a loss whose definition
        changed since the snapshot, a curriculum stage or a ramped weight, changes both scores alike); ``None``:
        not scored, its score when it was taken stands in. ``trend``: the share of its recent progress the training
        loss gave back (``signals.loss_climb``; ``None``: not known), for the second yardstick, the recent past (the
        module docstring); a step probed for a climb alone is judged against the recent past only (by then a probe
        from an old data domain can have been forgotten far past the new domain's batches, and the snapshot
        yardstick's test against the batch holds for a spike, at the switch). A verdict that is no rise is kept as a
        measured state of the run. With no snapshot scored, nothing can be compared: no rise."""
        scored = sorted((s for s in kept if s in self.scores), reverse=True)
        sound = self.reference(kept)
        if sound is None:
            return ProbeVerdict(step, math.nan, None, now, batch_loss, rose=False, factor=self.factor)
        same_moment = reference_now is not None and math.isfinite(reference_now)
        before = reference_now if same_moment and reference_now is not None else self.scores[sound]
        then = self.scores[sound]
        like_batch = batch_loss is None or not math.isfinite(now) or now >= self.of_batch * batch_loss
        loss_lost = trend.lost if trend is not None else None
        by_ref = self.rise(now, before) and like_batch and not (trend is not None and trend.climb_only)
        # The recent past, as ratios to the reference's weights at the same moment: the reference itself (1), and the
        # spikes held against it lately.
        lately_rel, lately_step = min(
            [(1.0, sound)]
            + [(rel, s) for s, (ref, rel) in self.held.items() if ref == sound and step - RECENT <= s < step]
        )
        lost = lately = None
        if before > 0 and then > 0:
            lately = lately_rel * before
            lost = given_back(now / before, lately_rel, (self.first or 0.0) / then)
        # The probe's rows still like the data the run trains on now: a probe from an old data domain, forgotten, loses
        # far more than the new domain's batches do (a divergence makes both lose alike).
        like_level = (
            trend is None or trend.level is None or not math.isfinite(now) or now <= trend.level / self.of_batch
        )
        by_recent = (
            not by_ref
            and like_batch
            and like_level
            and lost is not None
            and lost >= LOST
            and loss_lost is not None
            and loss_lost >= CLIMB_LOST
        )
        rose = by_ref or by_recent
        unsound = tuple(s for s in scored if s > sound) if rose else ()
        if not rose and math.isfinite(now) and before > 0:
            self.held = {s: v for s, v in self.held.items() if s >= step - RECENT}
            self.held[step] = (sound, now / before)
        return ProbeVerdict(
            step,
            before,
            sound,
            now,
            batch_loss,
            rose,
            unsound,
            self.factor,
            same_moment,
            lately,
            lately_step,
            lost,
            loss_lost,
            by_recent,
            trend is not None and trend.climb_only,
        )

    def restored(self, step: int) -> None:
        """The state of ``step`` was restored: the scores of later snapshots belong to the abandoned trajectory."""
        self.scores = {s: v for s, v in self.scores.items() if s <= step}
        self.held = {s: v for s, v in self.held.items() if s <= step}
