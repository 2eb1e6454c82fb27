"""The per-Trainer engine: sense, diagnose, decide, act and report, once per optimizer step.

Every nanguard callback joins the engine in ``setup`` and registers what it brings (``capabilities``). The first
callback to join in a fit *drives*: its hooks forward to the engine, the others' hooks return at once, so the
stages run once per step whatever the callbacks' order and number. A healthy step costs the sensor's one fused pass
and one host read (zero on the device-flag paths) plus a few attribute checks here; everything else happens on the
incident path (``incidents.handle``), which runs on every rank with rank-reduced inputs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_nanguard import _lightning_compat
from lightning_nanguard.contract import Signal
from lightning_nanguard.engine.bus import EventBus
from lightning_nanguard.engine.capabilities import (
    SIGNAL_OF_SPIKE,
    Backoff,
    CollapseFacts,
    GuardSettings,
    MetricSource,
    Promoter,
    Restorer,
    ScaleWatch,
)
from lightning_nanguard.engine.sensing import QuickStep, Reading, Sensor
from lightning_nanguard.engine.sink import IncidentSink
from lightning_nanguard.engine.state_check import state_before_update, state_verdict
from lightning_nanguard.exceptions import NanGuardConfigError
from lightning_nanguard.forensics import ReplayBook
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.recovery.step_skip import drop_update
from lightning_nanguard.reporting import emit
from lightning_nanguard.signals.model_tensors import record_intended_infinities, watched_buffers
from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["Engine", "PendingEvent", "get_engine"]


class PendingEvent:
    """One event of the current batch, collected during the step and handled at the batch end."""

    __slots__ = ("collapse", "readings", "signal")

    def __init__(self, signal: Signal, readings: list[Reading], collapse: CollapseFacts | None = None) -> None:
        self.signal = signal
        self.readings = readings
        self.collapse = collapse


class Engine:
    """Shared, per-Trainer nanguard state. Get it with ``get_engine(trainer)``; never construct it directly."""

    def __init__(self) -> None:
        self.sensor = Sensor()
        self.sink = IncidentSink()
        self.bus = EventBus()
        self.members: list[Any] = []
        self._fit_open = False
        self._reset_registry()
        self._reset_fit()

    # ------------------------------------------------------------------ registry (set in the callbacks' setup)
    def _reset_registry(self) -> None:
        self.guard: GuardSettings | None = None
        self.restorer: Restorer | None = None
        self.backoff: Backoff | None = None
        self.scale_watch: ScaleWatch | None = None
        self.promoter: Promoter | None = None
        self.metric_sources: list[MetricSource] = []
        # Run first at each batch end, after the optimizer step: DeepSpeed's own step outcome is read there
        # (callbacks/_deepspeed.py), since its engine steps after the last hook Lightning gives before it.
        self.step_hooks: list[Any] = []
        self.monitors_steps = False  # some member watches training steps (sensing runs)
        self.quarantine: Quarantine | None = None
        self.driver: Any = None
        self._spikes: tuple[RunningZScore, RunningZScore] | None = None
        # Shows or hides the driver's ``on_train_batch_start`` (``_base.bind_engine_hooks``); None: always shown.
        self.batch_start_switch: Any = None

    def _reset_fit(self) -> None:
        self._losses: list[Tensor] = []
        self._readings: list[Reading] = []
        self._events: list[PendingEvent] = []
        self._batch: Any = None
        self._batch_idx = -1
        self._drop_reason = ""  # set at batch start: this batch's update is dropped without an incident
        self.skipped_steps = 0  # updates dropped by nanguard or the GradScaler in this fit
        self.skip_streak = 0
        self.recent_skips: deque[int] = deque(maxlen=256)  # steps of non-data drops (OptimizerBackoff's skip rule)
        self.history: deque[tuple[int, float, float | None]] = deque(maxlen=64)  # (step, grad_norm, loss)
        self.interval = _Interval()
        self._quick: QuickStep | None = None  # this batch's step, read by ``Sensor.quick``, finite (batch end)
        self._last_quick: QuickStep | None = None  # the last step, when it was such a one: ``last_reading`` from it
        self._last_quick_batch = -1
        self._last_reading: Reading | None = None  # ``last_reading``
        self.finite_steps = 0  # steps of this fit whose reading was finite
        self.resumed_from: str | None = None
        self.pending_error: BaseException | None = None
        self.finished = False
        self.final_state = ""
        self.module_overflows: dict[str, int] = {}
        self.replays = ReplayBook()  # forensics over this fit: replay time spent, replays kept per evidence
        self.step_seconds = math.nan  # moving average of a healthy batch's wall time
        self._batch_began = 0.0
        self._host_only = False
        self._agree_scaler = False  # DDP + GradScaler with no step sensing: the scalers' skips are still agreed
        self._starts = True  # batch_start runs (False: hidden, its bookkeeping done at the batch end)
        self._lean_end = False  # no step hook, no scale watch: ``on_train_batch_end``'s healthy path may apply
        # Lightning's logging-step test for this fit (``LoggingSteps.due``, set at the start of training).
        self._logging_due: Any = _lightning_compat.is_train_logging_step

    # ------------------------------------------------------------------ membership
    def join(self, trainer: pl.Trainer, member: Any, *, fit: bool = True) -> bool:
        """A callback's ``setup``. Returns True for the member whose hooks drive the engine this fit."""
        if not self._fit_open:
            self._fit_open = True
            self.members = []
            self._reset_registry()
            self._reset_fit()
            self.sensor.reset()
            self.bus.clear()
            self.sink.start(trainer)
        if member not in self.members:
            self.members.append(member)
        if fit and self.driver is None:
            self.driver = member
        return self.driver is member

    def close(self) -> None:
        """A callback's ``teardown``: the next ``setup`` starts a new fit."""
        if self.quarantine is not None:
            self.quarantine.detach()
        self._fit_open = False
        self.driver = None
        self._readings.clear()
        self._quick = None
        self._losses.clear()
        self._batch = None

    @property
    def member_names(self) -> list[str]:
        return sorted({type(m).__name__ for m in self.members})

    # ------------------------------------------------------------------ registration (typed, one of each kind)
    def set_guard(self, settings: GuardSettings, quarantine: Quarantine | None) -> None:
        if self.guard is not None and self.guard != settings:
            raise NanGuardConfigError(
                f"Two GradNormMonitors with different settings are installed ({self.guard} and {settings}): one "
                "guard decides every step. Remove one of them."
            )
        self.guard = settings
        self.quarantine = quarantine
        self.monitors_steps = True
        if settings.spike_zscore is not None:
            self._spikes = (
                RunningZScore(settings.spike_zscore, settings.spike_warmup),
                RunningZScore(settings.spike_zscore, settings.spike_warmup),
            )
        # A spike that must be dropped has to be judged on the host before the update: no device path then.
        self._host_only = (settings.spike_zscore is not None and settings.on_spike != "warn") or (
            settings.on_nonfinite == "warn"
        )

    def set_restorer(self, restorer: Restorer) -> None:
        self._register("restorer", restorer)
        self.monitors_steps = True

    def set_backoff(self, backoff: Backoff) -> None:
        self._register("backoff", backoff)

    def set_scale_watch(self, watch: ScaleWatch) -> None:
        self._register("scale_watch", watch)
        self.monitors_steps = True

    def set_promoter(self, promoter: Promoter) -> None:
        self._register("promoter", promoter)

    def add_metrics(self, source: MetricSource) -> None:
        if source not in self.metric_sources:
            self.metric_sources.append(source)

    def _register(self, slot: str, obj: Any) -> None:
        current = getattr(self, slot)
        if current is not None and current is not obj:
            raise NanGuardConfigError(
                f"Two {type(obj).__name__} callbacks are installed on one Trainer: each remedy has one owner. "
                "Remove one of them."
            )
        setattr(self, slot, obj)

    @property
    def spikes(self) -> tuple[RunningZScore, RunningZScore] | None:
        return self._spikes

    # ------------------------------------------------------------------ hooks (driver only)
    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.resumed_from = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        self.finite_steps = 0
        if self.guard is not None:
            self.sensor.layer_depth = 1
        intended = record_intended_infinities(pl_module)
        if intended:
            rank_zero_info(
                f"nanguard: buffer(s) {', '.join(intended[:5])}{' ...' if len(intended) > 5 else ''} hold infinities "
                "(and no NaN) at the start of training, e.g. an attention mask of -inf: treated as intended, checked "
                "for NaN only."
            )
        if self.monitors_steps:
            self.sensor.watch_buffers(watched_buffers(pl_module))
        scaler = _lightning_compat.get_scaler(trainer)
        self._agree_scaler = trainer.world_size > 1 and scaler is not None and scaler.is_enabled()
        if _lightning_compat.clipping_possible(trainer, pl_module):  # else nothing to guard: no wrapper per step
            _lightning_compat.guard_clipping(trainer, self._clip_allowed)
        self._logging_due = _lightning_compat.LoggingSteps(trainer).due
        self._lean_end = not self.step_hooks and self.scale_watch is None
        self.refresh_batch_start()

    def refresh_batch_start(self) -> None:
        """Hide the driver's ``on_train_batch_start`` while a batch start has nothing to decide: no restorer (its
        snapshots and triggers run there) and nothing quarantined (no batch can be dropped). Its bookkeeping (the
        batch, the quarantine's place in the batches, the step clock) is then done at the batch end. Shown again
        for good once something is quarantined (after an incident, before the next batch)."""
        switch = self.batch_start_switch
        if switch is None:
            return
        needed = self.restorer is not None or (self.quarantine is not None and self.quarantine.active)
        if needed != self._starts:
            switch(needed)
            self._starts = needed

    def train_epoch_start(self, trainer: pl.Trainer) -> None:
        if self.quarantine is not None:
            self.quarantine.attach(trainer, self.sink.log_dir)
        if not self._starts:
            self._batch_began = 0.0  # timed end to end: the first batch of an epoch would count the epoch's turnover

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch, self._batch_idx = batch, batch_idx
        self._batch_began = time.perf_counter()
        self._drop_reason = ""
        if self.quarantine is not None and self.quarantine.begin_batch(batch):
            self._drop_reason = "quarantined"
        if self.restorer is not None:
            step = trainer.global_step
            signal = None
            if not self.restorer.before_batch(trainer, pl_module, step):
                signal = self._unsound_signal(trainer, pl_module)
            elif self.restorer.diverging():
                signal = Signal.DIVERGING
            if signal is not None:
                # Handled now, so that a restore lets this batch run on a good state.
                self._events.append(PendingEvent(signal, []))
                self._handle_events(trainer, pl_module)
                if self.pending_error is not None:
                    # Nothing could restore it: training stops after this batch, whose update is dropped without a
                    # second incident for the same event.
                    self._drop_reason = "stopping"
            if self.restorer.skip_batch():
                self._drop_reason = self._drop_reason or "after_rollback"

    def check_state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Check the parameters and buffers now (a collective: every rank must call it); a non-finite state, or under
        DDP parameters that differ across ranks, is an event handled at once. True when the state was sound."""
        verdict = state_verdict(trainer, pl_module)
        if verdict.sound:
            return True
        signal = Signal.NONFINITE_STATE if not verdict.finite else Signal.RANK_DIVERGENCE
        self._events.append(PendingEvent(signal, []))
        self._handle_events(trainer, pl_module)
        return False

    @staticmethod
    def _unsound_signal(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Signal:
        """Which way the state is unsound, where every rank just found it so (a collective, incident path only)."""
        verdict = state_verdict(trainer, pl_module)
        return Signal.RANK_DIVERGENCE if verdict.finite and verdict.diverged else Signal.NONFINITE_STATE

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Keep the step's (micro-batch) loss, not detached (``Sensor``: a detach is a device op, done there where
        needed). The hook's signature: the driver's hook is bound to it directly (``_base.bind_engine_hooks``)."""
        self._losses.append(loss)

    def before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        if not self.monitors_steps:
            self._losses.clear()
            if self._agree_scaler:
                _lightning_compat.agree_scaler_skip(trainer, optimizer)
            return
        losses, self._losses = self._losses, []
        # The common step's fused path (``Sensor.quick``): one host read, no layers; None where it does not apply.
        quick = self.sensor.quick(optimizer, losses, trainer.global_step)
        if quick is not None:
            if (
                math.isfinite(quick[2])
                and math.isfinite(quick[3])
                and self._quick is None
                and not self._readings
                and self._lean_end
                and self._spikes is None
                and not self._drop_reason
            ):
                # Finite, and nothing to decide: the batch end accounts for it (its Reading is made only if asked
                # for: ``last_reading``).
                self._quick = quick
                return
            reading = self.sensor.quick_reading(quick, self._batch_idx)
        else:
            reading = self.sensor.measure(
                trainer,
                pl_module,
                optimizer,
                losses,
                step=trainer.global_step,
                batch=self._batch_idx,
                host_only=self._host_only,
            )
        self._readings.append(reading)
        path = reading.path
        if reading.pending is not None:  # device path: the optimizer acts on the verdict itself
            if self._drop_reason:
                drop_update(optimizer, path)
                reading.dropped = True
            return
        drop = bool(self._drop_reason)
        if reading.bad:
            # Incident path only: the state as it was before this update (the event is handled after it).
            reading.state_before = state_before_update(trainer, pl_module)
            if path == "scaler":
                # Every rank's scaler drops it and backs off together, even where this rank's gradients are finite.
                _lightning_compat.or_into_found_inf(
                    _lightning_compat.get_scaler(trainer), optimizer, _lightning_compat.true_flag(optimizer)
                )
                reading.dropped = True
            elif self._drops_nonfinite():
                drop = True
        elif self._spikes is not None:
            reading.spike = self._spike(reading)
            drop = drop or (bool(reading.spike) and self.guard is not None and self.guard.on_spike != "warn")
        if drop and not reading.dropped:
            drop_update(optimizer, path)
            reading.dropped = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """``batch_end`` with the hook's signature (the driver's hook, bound directly: ``_base.bind_engine_hooks``).

        A batch whose one step ``Sensor.quick`` read finite with nothing to decide (``before_optimizer_step``), in a
        fit with no step hook and no scale watch, is accounted for here in a few assignments: what ``_account`` does
        with such a step, written out (this runs every step)."""
        readings = self._readings
        starts = self._starts
        if not starts:  # what ``batch_start`` would have recorded
            self._batch, self._batch_idx = batch, batch_idx
            for reading in readings:
                reading.batch = batch_idx
            if self.quarantine is not None:
                self.quarantine.next_batch()
        quick = self._quick
        if quick is not None:
            self._quick = None
            if readings or self._events:  # not alone in this batch: the general path, in step order
                readings.insert(0, self.sensor.quick_reading(quick, self._batch_idx))
            else:
                self._last_quick, self._last_quick_batch = quick, self._batch_idx
                norm, loss, step = quick[2], quick[3], quick[4]
                interval = self.interval
                interval.steps += 1
                interval.grad_norm = norm
                if norm > interval.grad_norm_max:
                    interval.grad_norm_max = norm
                interval.loss = loss
                self.finite_steps += 1
                self.history.append((step, norm, loss))
                self.skip_streak = 0
                now = time.perf_counter()
                if self._batch_began:
                    took, average = now - self._batch_began, self.step_seconds
                    # At most 4x the average per batch: a validation run between two batch ends is not a step.
                    self.step_seconds = took if math.isnan(average) else 0.9 * average + 0.1 * min(took, 4 * average)
                if not starts:
                    self._batch_began = now  # the next batch is timed from here (end to end: its data loading too)
                if self._logging_due(trainer):
                    self._flush_metrics(trainer)
                return
        self.batch_end(trainer, pl_module)
        if not starts:
            self._batch_began = time.perf_counter()

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self.step_hooks:
            hook(trainer)
        readings, self._readings = self._readings, []
        for reading in readings:
            if reading.pending is not None and Sensor.resolve(reading):
                # Device path: the verdict reaches the host now, synchronized already.
                if reading.bad:
                    reading.dropped = True
                elif self._spikes is not None:
                    reading.spike = self._spike(reading)
            if reading.path == "fused":
                _lightning_compat.clear_found_inf_of(trainer, reading.optimizer_idx)
            self._account(trainer, reading)
        if self._events:
            self._handle_events(trainer, pl_module)
        elif self._batch_began:
            # A healthy batch's wall time (host clock only): forensics bounds a replay by it (max_replay_steps).
            took, average = time.perf_counter() - self._batch_began, self.step_seconds
            self.step_seconds = took if math.isnan(average) else 0.9 * average + 0.1 * min(took, 4 * average)
        if self.scale_watch is not None:
            self.scale_watch.after_step(trainer, readings)
        if self._logging_due(trainer):
            self._flush_metrics(trainer)

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """End of training: the end-of-fit state check (once, whoever calls it first), the summary, a pending stop.

        The driver calls it; so do members that never drive (CheckpointGuard, FP32Evaluation), so that a fit with
        only those installed also never returns non-finite parameters.
        """
        from lightning_nanguard.engine.incidents import final_check

        if not self.final_state:
            final_check(self, trainer, pl_module)  # a collective: every rank reaches on_train_end
        self.finish(trainer, raise_pending=True)

    def finish(self, trainer: pl.Trainer, *, raise_pending: bool) -> None:
        """Print the summary once, then raise a pending stop error (once)."""
        if not self.finished:
            self.finished = True
            notes = self.quarantine.summary_lines() if self.quarantine is not None else []
            self.sink.summary(
                trainer,
                self.member_names,
                monitored=self.monitors_steps or bool(self.step_hooks),
                final_state=self.final_state,
                notes=notes,
            )
        if raise_pending and self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise error

    def request_stop(self, trainer: pl.Trainer, error: BaseException) -> None:
        """Stop after this batch (all ranks: only rank-reduced decisions call this); raise ``error`` at train end."""
        trainer.should_stop = True
        if self.pending_error is None:
            self.pending_error = error

    @property
    def last_reading(self) -> Reading | None:
        """The last step's reading (what the logging step's metrics read); made from ``Sensor.quick``'s values on
        first use where that step had none."""
        quick = self._last_quick
        if quick is not None:
            self._last_quick = None
            self._last_reading = self.sensor.quick_reading(quick, self._last_quick_batch)
        return self._last_reading

    @last_reading.setter
    def last_reading(self, reading: Reading | None) -> None:
        self._last_quick = None
        self._last_reading = reading

    # ------------------------------------------------------------------ per-step bookkeeping (host floats only)
    def _drops_nonfinite(self) -> bool:
        if self.restorer is not None:
            return True
        return self.guard is not None and self.guard.on_nonfinite != "warn"

    def _spike(self, reading: Reading) -> str:
        assert self._spikes is not None
        grad_z, loss_z = self._spikes
        grad_spike = reading.has_grads and grad_z.observe(reading.grad_norm)
        loss_spike = reading.loss is not None and loss_z.observe(reading.loss)
        if grad_spike or loss_spike:
            reading.zscores = {"grad_norm_zscore": grad_z.last_z, "loss_zscore": loss_z.last_z}
        signal = SIGNAL_OF_SPIKE.get((bool(loss_spike), bool(grad_spike)))
        return signal.value if signal is not None else ""

    def _account(self, trainer: pl.Trainer, reading: Reading) -> None:
        self.last_reading = reading
        self.interval.observe(reading)
        if reading.dropped:
            self.skipped_steps += 1
        collapse = None
        if self.scale_watch is not None and reading.scale is not None:
            collapse = self.scale_watch.observe(trainer, reading)
        if reading.bad:
            self.skip_streak += 1
            if self._drop_reason == "stopping":
                return  # the stop this batch started with is the incident
            if collapse is not None:
                self._events.append(PendingEvent(Signal.LOSS_SCALE_COLLAPSE, [reading], collapse))
            else:
                self._events.append(PendingEvent(_nonfinite_signal(reading), [reading]))
            return
        self.finite_steps += 1
        self.history.append((reading.step, reading.grad_norm, reading.loss))
        if reading.spike:
            self._events.append(PendingEvent(Signal(reading.spike), [reading]))
            if reading.dropped:
                self.skip_streak += 1
            return
        if not reading.dropped:
            self.skip_streak = 0

    def _handle_events(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_nanguard.engine.incidents import handle

        events, self._events = self._events, []
        handle(self, trainer, pl_module, events)
        if not self._starts:
            self.refresh_batch_start()  # something may have been quarantined

    def _clip_allowed(self) -> bool:
        """Lightning clips after ``on_before_optimizer_step``: nothing to clip once the update was dropped."""
        return not (self._readings and self._readings[-1].dropped)

    def _flush_metrics(self, trainer: pl.Trainer) -> None:
        if not trainer.loggers:
            # Nothing to write them to (``logger=False``): the interval starts over without computing them (the
            # per-layer norms cost device ops and a host read). Every rank has the same loggers: rank-consistent.
            self.interval.reset()
            return
        metrics: dict[str, float] = {}
        for source in self.metric_sources:
            metrics.update(source(trainer))
        self.interval.reset()
        emit.log_event(trainer, metrics)

    @property
    def replay_ms(self) -> float:
        """Forensics' replay time in this fit."""
        return self.replays.spent_ms

    # ------------------------------------------------------------------ current batch (incident path)
    @property
    def batch(self) -> Any:
        return self._batch

    @property
    def batch_idx(self) -> int:
        return self._batch_idx


class _Interval:
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


def _nonfinite_signal(reading: Reading) -> Signal:
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


class _EngineSlot:
    """Where a Trainer keeps its engine (``Trainer._nanguard_engine``): it lives and dies with the Trainer.

    Not a module-level map from Trainer to engine: the engine refers back to the Trainer through its members
    (CheckpointGuard keeps the Trainer), so even a ``WeakKeyDictionary`` would keep every fitted Trainer, with its
    model, optimizer state and data, alive for the life of the process. Pickled empty: a spawned rank unpickles a
    fresh engine, as it would have built one on first use.
    """

    __slots__ = ("engine",)

    def __init__(self) -> None:
        self.engine = Engine()

    def __reduce__(self) -> tuple[type[_EngineSlot], tuple[()]]:
        return (_EngineSlot, ())


def get_engine(trainer: pl.Trainer) -> Engine:
    """The nanguard engine of ``trainer`` (created on first use, kept on the Trainer, dropped with it)."""
    slot = trainer.__dict__.get("_nanguard_engine")
    if slot is None:
        slot = trainer.__dict__["_nanguard_engine"] = _EngineSlot()
    return slot.engine
