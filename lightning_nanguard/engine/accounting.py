"""The step's accounting: what one reading adds to the fit's record, and which event it is (host floats only).

``FitLedger`` is what this fit has recorded that a decision or a report reads: dropped updates and their streak,
the recent history, the logging interval, the step time, the overflows per module, forensics' replays, the stop to
raise at the end of training. The engine's quick path writes the healthy step's part of it inline.
"""

from __future__ import annotations

import math
from collections import deque
from enum import Enum

import lightning.pytorch as pl

from lightning_nanguard.contract import Signal
from lightning_nanguard.engine.events import PendingEvent
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.forensics import ReplayBook
from lightning_nanguard.policies.loss_scale import CollapseFacts
from lightning_nanguard.policies.withdrawal import Blames
from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["DropReason", "FitLedger", "Interval", "judge_spike", "nonfinite_signal", "spike_of"]

_SPIKE_OF = {  # (loss spiked, grad norm spiked) -> the signal
    (True, False): Signal.LOSS_SPIKE,
    (False, True): Signal.GRAD_NORM_SPIKE,
    (True, True): Signal.LOSS_AND_GRAD_NORM_SPIKE,
}


class DropReason(Enum):
    """Why this batch's update is dropped without an incident of its own (decided at the batch start)."""

    QUARANTINED = "quarantined"  # the batch holds quarantined data
    STOPPING = "stopping"  # nothing could restore the state the batch started with: training stops after it
    AFTER_ROLLBACK = "after_rollback"  # one of AutoRollback's skip_batches after a rollback


class Interval:
    """Host statistics over the current logging interval, so a bad step is never hidden by the sampling."""

    __slots__ = ("grad_norm", "grad_norm_max", "loss", "nonfinite_steps", "steps")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.grad_norm = math.nan
        self.grad_norm_max = -math.inf
        self.loss = math.nan
        self.nonfinite_steps = 0
        self.steps = 0

    def observe(self, reading: Reading) -> None:
        self.steps += 1
        if reading.has_grads:
            if reading.grads_finite:
                self.grad_norm = reading.grad_norm
            if not reading.grads_finite or reading.grad_norm > self.grad_norm_max:
                self.grad_norm_max = reading.grad_norm if reading.grads_finite else math.inf
        if reading.loss is not None:
            self.loss = reading.loss
        if reading.bad:
            self.nonfinite_steps += 1


class FitLedger:
    """This fit's record of its steps (identical on every rank: built from reduced readings only)."""

    def __init__(self) -> None:
        self.skipped_steps = 0  # updates dropped by nanguard or the GradScaler in this fit
        self.skip_streak = 0
        self.recent_skips: deque[int] = deque(maxlen=256)  # steps of drops a lower LR answers (the skip backoff)
        self.dropped_steps: deque[int] = deque()  # steps of drops no rollback answered, within the dropped window
        self.history: deque[tuple[int, float, float | None]] = deque(maxlen=64)  # (step, grad_norm, loss)
        self.interval = Interval()
        self.finite_steps = 0  # steps of this fit whose reading was finite
        self.step_seconds = math.nan  # moving average of a healthy batch's wall time
        self.module_overflows: dict[str, int] = {}
        self.resumed_from: str | None = None
        self.replays = ReplayBook()  # forensics over this fit
        self.pending_error: BaseException | None = None  # raised at the end of training
        self.final_state = ""  # the end-of-fit check's verdict, in one phrase ("" until it ran)
        self.blames = Blames()  # the fit's data hypotheses and their quarantines (``policies.withdrawal``)

    def time_batch(self, took: float) -> None:
        """Fold one healthy batch's wall time into the average (forensics bounds a replay by it). One sample counts
        for at most 4x the average: a validation run between two batch ends is not a step."""
        average = self.step_seconds
        self.step_seconds = took if math.isnan(average) else 0.9 * average + 0.1 * min(took, 4 * average)

    def account(
        self, reading: Reading, collapse: CollapseFacts | None, *, stopping: bool, quarantined: bool = False
    ) -> PendingEvent | None:
        """Count one step; the event it is, if any (``stopping``: the stop this batch started with is the
        incident, the bad step is only counted; ``quarantined``: the batch holds quarantined data, its update was
        dropped and the quarantine counts it, so a bad step on it with the state intact is no event: its buffers
        finite after the forward, and, where the incident path read it, the state before the update)."""
        self.interval.observe(reading)
        if reading.dropped:
            self.skipped_steps += 1
        if reading.bad:
            if quarantined and reading.buffers_finite and (reading.state_before is None or reading.state_before[0]):
                return None
            self.skip_streak += 1
            if stopping:
                return None
            if collapse is not None:
                return PendingEvent(Signal.LOSS_SCALE_COLLAPSE, [reading], collapse)
            return PendingEvent(nonfinite_signal(reading), [reading])
        self.finite_steps += 1
        self.history.append((reading.step, reading.grad_norm, reading.loss))
        if reading.spike is not None:
            if reading.dropped:
                self.skip_streak += 1
            return PendingEvent(reading.spike, [reading])
        if not reading.dropped:
            self.skip_streak = 0
        return None

    def request_stop(self, trainer: pl.Trainer, error: BaseException) -> None:
        """Stop after this batch (all ranks: only rank-reduced decisions call this); raise ``error`` at train end."""
        trainer.should_stop = True
        if self.pending_error is None:
            self.pending_error = error


def nonfinite_signal(reading: Reading) -> Signal:
    loss_bad, grads_bad = not reading.loss_finite, not reading.grads_finite
    if not (loss_bad or grads_bad):
        return Signal.NONFINITE_STATE  # a watched buffer (BatchNorm statistics) went non-finite in the forward
    if loss_bad and grads_bad:
        return Signal.NONFINITE_LOSS_AND_GRADS
    if loss_bad:
        return Signal.NONFINITE_LOSS
    if grads_bad and reading.has_grads:
        return Signal.NONFINITE_GRADS
    return Signal.NONFINITE_ON_OTHER_RANK


def judge_spike(spikes: tuple[RunningZScore, RunningZScore], reading: Reading) -> Signal | None:
    """The spike a finite step is (its z-scores kept on the reading), or ``None``."""
    spike, zscores = spike_of(spikes, reading.grad_norm if reading.has_grads else None, reading.loss)
    if zscores is not None:
        reading.zscores = zscores
    return spike


def spike_of(
    spikes: tuple[RunningZScore, RunningZScore], grad_norm: float | None, loss: float | None
) -> tuple[Signal | None, dict[str, float] | None]:
    """The spike a finite step's host values are, and its z-scores (``None`` where it is none)."""
    grad_z, loss_z = spikes
    grad_spike = grad_norm is not None and grad_z.observe(grad_norm)
    loss_spike = loss is not None and loss_z.observe(loss)
    if not (grad_spike or loss_spike):
        return None, None
    return _SPIKE_OF[(bool(loss_spike), bool(grad_spike))], {
        "grad_norm_zscore": grad_z.last_z,
        "loss_zscore": loss_z.last_z,
    }
