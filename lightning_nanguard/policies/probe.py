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
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = ["PROBE_OF_BATCH", "PROBE_ROSE_FACTOR", "PROBE_ROSE_FLOOR", "ProbeBook", "ProbeVerdict"]

# A rise of the probe's loss this large (a ratio) is the weights going wrong: one update on a hard or new batch moves
# the probe's loss by a few percent; a divergence multiplies it.
PROBE_ROSE_FACTOR = 2.0
# ... and by at least this share of the probe's loss at the first snapshot (the scale of the task's loss).
PROBE_ROSE_FLOOR = 0.05
# ... and the probe doing at least this share as badly as the spiking batch (a new domain's batch loses far more).
PROBE_OF_BATCH = 0.5


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

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before > 0 else math.inf

    def summary(self) -> str:
        """``"probe loss 0.0213 at the snapshot of step 100 -> 0.87 at step 131 (40.8x; the batch's loss 1.2)"``."""
        batch = "" if self.batch_loss is None else f"; the spiking batch's loss {self.batch_loss:.3g}"
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

    def reset(self) -> None:
        self.scores.clear()
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
    ) -> ProbeVerdict:
        """The probe's loss ``now`` at a spike of ``step`` (whose batch lost ``batch_loss``), against the newest
        sound snapshot among ``kept`` (the snapshots a rollback can restore). ``reference_now``: that snapshot's
        weights scored now, on the same rows under the same objective (like with like: a loss whose definition
        changed since the snapshot, a curriculum stage or a ramped weight, changes both scores alike); ``None``:
        not scored, its score when it was taken stands in. With no snapshot scored, nothing can be compared: no
        rise."""
        scored = sorted((s for s in kept if s in self.scores), reverse=True)
        sound = self.reference(kept)
        if sound is None:
            return ProbeVerdict(step, math.nan, None, now, batch_loss, rose=False, factor=self.factor)
        same_moment = reference_now is not None and math.isfinite(reference_now)
        before = reference_now if same_moment and reference_now is not None else self.scores[sound]
        like_batch = batch_loss is None or not math.isfinite(now) or now >= self.of_batch * batch_loss
        rose = self.rise(now, before) and like_batch
        unsound = tuple(s for s in scored if s > sound) if rose else ()
        return ProbeVerdict(step, before, sound, now, batch_loss, rose, unsound, self.factor, same_moment)

    def restored(self, step: int) -> None:
        """The state of ``step`` was restored: the scores of later snapshots belong to the abandoned trajectory."""
        self.scores = {s: v for s, v in self.scores.items() if s <= step}
