"""The per-Trainer engine: sense, diagnose, decide, act and report, once per optimizer step.

Every nanguard callback joins the engine in ``setup`` and registers what it brings (``registry``). The first
callback to join in a fit *drives*: its hooks forward to the engine, the others' hooks return at once, so the
stages run once per step whatever the callbacks' order and number. A healthy step costs the sensor's one fused pass
and one host read (zero on the device-flag paths) plus a few attribute checks here; everything else happens on the
incident path (``incidents.IncidentPath``), which runs on every rank with rank-reduced inputs.

The pieces, each with one job: ``registry`` holds what the callbacks registered, ``sensing`` reads the step,
``accounting`` keeps the fit's record and says which event a step is, ``incidents`` (with ``diagnose``, ``decide``,
``act``) handles the events, ``final_check`` checks the state at the end of the fit, and ``step.StepFlow`` runs the
per-step hooks. This class builds them for each fit, lets the callbacks join and register, and ends the fit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_nanguard import _lightning_compat, _notices
from lightning_nanguard.config import GradNormMonitorConfig
from lightning_nanguard.contract import StateRestored
from lightning_nanguard.engine.accounting import FitLedger
from lightning_nanguard.engine.bus import EventBus
from lightning_nanguard.engine.capabilities import Backoff, MetricSource, Promoter, Restorer, ScaleWatch
from lightning_nanguard.engine.events import PendingEvent
from lightning_nanguard.engine.final_check import final_check
from lightning_nanguard.engine.incidents import IncidentPath
from lightning_nanguard.engine.parts import Parts
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.engine.sensing import Sensor
from lightning_nanguard.engine.sink import IncidentSink
from lightning_nanguard.engine.step import StepFlow
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.signals.loss_climb import ClimbingLoss
from lightning_nanguard.signals.model_tensors import record_intended_infinities
from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["Engine"]


class Engine(StepFlow):
    """Shared, per-Trainer nanguard state. Get it with ``get_engine(trainer)``; never construct it directly.

    The per-step hooks are its own methods (``StepFlow``); ``registry``, ``ledger``, ``incidents`` are this fit's.
    """

    def __init__(self) -> None:
        self.sensor = Sensor()
        self.sink = IncidentSink()
        self.bus = EventBus()
        self.members: list[Callback] = []
        self._fit_open = False
        self._start_fit()

    def __reduce__(self) -> tuple[type[Engine], tuple[()]]:
        """Pickled empty (a Trainer saved with ``torch.save``, a spawned rank): a fit's engine state is for that fit
        only, and holds what cannot be pickled (CUDA events, pinned buffers)."""
        return (Engine, ())

    def _start_fit(self) -> None:
        self.registry = Registry()
        self.ledger = FitLedger()
        self.incidents = IncidentPath(self.registry, self.ledger, self.sink, self.bus)
        self.driver: Callback | None = None
        self.batch_start_switch = None
        self.finished = False
        self.train_ended = False  # the first end-of-fit check ran (``on_train_end``)
        self.fit_ended = False  # the second ran (the first member's ``teardown``)
        self._left: set[int] = set()  # ids of the members whose ``teardown`` has run
        self.began = False  # training or an evaluation began (a fit refused at setup has no summary)
        self.first_step = 0  # global_step when training began
        self.parts = Parts()
        self.train_started = False  # ``train_start`` ran (once, whoever calls it first)
        self._start_steps()

    # ------------------------------------------------------------------ membership
    def join(self, trainer: pl.Trainer, member: Callback, *, fit: bool = True) -> bool:
        """A callback's ``setup``. Returns True for the member whose hooks drive the engine this fit."""
        if not self._fit_open:
            self._fit_open = True
            self.members = []
            self._start_fit()
            self.sensor.reset()
            self.bus.clear()
            self.sink.start(trainer)
        self.registry.admit(member)  # a second callback of one kind is refused here, before any step
        if member not in self.members:
            self.members.append(member)
        if fit and self.driver is None:
            self.driver = member
        return self.driver is member

    def leave(self, member: Callback) -> None:
        """A member's ``teardown``, its last act: once every member has left, the fit is closed (``close``) and a
        pending stop error raised. Raised only then, so that every member's ``teardown`` has run first."""
        self._left.add(id(member))
        if not self._fit_open or any(id(m) not in self._left for m in self.members):
            return
        self.close()
        if self.ledger.pending_error is not None:
            error, self.ledger.pending_error = self.ledger.pending_error, None
            raise error

    def close(self) -> None:
        """The fit is over: the next ``setup`` starts a new one."""
        if self.registry.quarantine is not None:
            self.registry.quarantine.detach()
        self._fit_open = False
        self.driver = None
        self._readings.clear()
        self._quick = None
        self._losses.clear()
        self._following = []
        self._batch = None
        self._micro.clear()
        self._window_losses = []

    def forwards_evaluation(self, member: Callback) -> bool:
        """``member`` forwards Lightning's evaluation hooks to the engine: the first member of the open fit."""
        return self._fit_open and bool(self.members) and self.members[0] is member

    @property
    def member_names(self) -> list[str]:
        return sorted({type(m).__name__ for m in self.members})

    # ------------------------------------------------------------------ registration (the callbacks' setup)
    def set_guard(self, settings: GradNormMonitorConfig, quarantine: Quarantine | None) -> None:
        self.registry.set_guard(settings, quarantine)

    def set_restorer(self, restorer: Restorer) -> None:
        self.registry.set_restorer(restorer)

    def set_backoff(self, backoff: Backoff) -> None:
        self.registry.set_backoff(backoff)

    def set_scale_watch(self, watch: ScaleWatch) -> None:
        self.registry.set_scale_watch(watch)

    def set_promoter(self, promoter: Promoter) -> None:
        self.registry.set_promoter(promoter)

    def add_metrics(self, source: MetricSource) -> None:
        self.registry.add_metrics(source)

    def add_summary_notes(self, source: Callable[[], list[str]]) -> None:
        """Lines ``source()`` returns at the end of fit go into the summary (after the incidents)."""
        self.registry.add_summary_notes(source)

    def add_part(self, part: object) -> None:
        """``part`` takes part in this fit's steps: its stage methods are called in ``engine/parts.py``'s order."""
        stages = self.parts.add(part)
        if stages.metrics is not None:
            self.add_metrics(stages.metrics)
        if stages.summary_lines is not None:
            self.add_summary_notes(stages.summary_lines)

    def post(self, event: PendingEvent) -> None:
        """An event found outside the engine's own sensing (DeepSpeed's step), handled with this batch's events."""
        self._events.append(event)

    def handle_now(self, trainer: pl.Trainer, event: PendingEvent) -> None:
        """An event that cannot wait for a batch end (DeepSpeed's own exit, seen in ``on_exception``)."""
        self._events.append(event)
        self._handle_events(trainer, trainer.lightning_module)

    # ------------------------------------------------------------------ what callbacks and reports read
    @property
    def restorer(self) -> Restorer | None:
        return self.registry.restorer

    @property
    def spikes(self) -> tuple[RunningZScore, RunningZScore] | None:
        return self.registry.spikes

    @property
    def history(self) -> deque[tuple[int, float, float | None]]:
        return self.ledger.history

    @property
    def skipped_steps(self) -> int:
        return self.ledger.skipped_steps

    # ------------------------------------------------------------------ hooks (driver only)
    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training starts (every member's ``on_train_start``; once, whoever calls first): the engine's own start
        where a member drives the steps, then every part's ``train_start``, in order."""
        if self.train_started:
            return
        self.train_started = True
        if self.driver is not None:
            self._start_training(trainer, pl_module)
        for stages in self.parts.with_stage("train_start"):
            assert stages.train_start is not None
            stages.train_start(trainer, pl_module)
        self._starters = self.parts.with_stage("batch_start")
        self.refresh_batch_start()

    def _start_training(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        registry = self.registry
        self.began, self.first_step = True, trainer.global_step
        self.ledger.resumed_from = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        self.ledger.finite_steps = 0
        if registry.guard is not None:
            self.sensor.layer_depth = 1
        intended = record_intended_infinities(pl_module)
        if intended:
            _notices.note(
                f"nanguard: buffer(s) {', '.join(intended[:5])}{' ...' if len(intended) > 5 else ''} hold infinities "
                "(and no NaN) at the start of training, e.g. an attention mask of -inf: treated as intended, checked "
                "for NaN only."
            )
        self._monitors, self._spikes, self._host_only = registry.monitors_steps, registry.spikes, registry.host_only
        guard = registry.guard
        self._probes = self._spikes is not None and guard is not None and guard.on_spike == "probe"
        if self._monitors:
            self.sensor.watch(pl_module)
            self.bus.subscribe(StateRestored, self._restored)
        scaler = _lightning_compat.get_scaler(trainer)
        self._agree_scaler = trainer.world_size > 1 and scaler is not None and scaler.is_enabled()
        if _lightning_compat.clipping_possible(trainer, pl_module):  # else nothing to guard: no wrapper per step
            _lightning_compat.guard_clipping(trainer, self._clip_allowed)
        self._logging_due = _lightning_compat.LoggingSteps(trainer).due
        self._lean_end = not registry.step_hooks and registry.scale_watch is None

    def train_epoch_start(self, trainer: pl.Trainer) -> None:
        super().train_epoch_start(trainer)
        if self._monitors:
            self.sensor.rewatch()  # a buffer registered again since (a cache that grew) is watched from now on

    def _restored(self, trainer: pl.Trainer, event: StateRestored) -> None:
        self.sensor.rewatch()  # a rollback may have reallocated a buffer
        if self._spikes is not None and isinstance(self._spikes[1], ClimbingLoss):
            self._spikes[1].restart()  # the restored state's losses are measured from its own level

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """End of training (``on_train_end``): the end-of-fit state check, on the device, as training left the state
        (once, whoever calls it first), then every part's ``train_end``. Every member calls it, those that never drive
        (CheckpointGuard, FP32Evaluation) too, so that a fit with only those installed also never returns non-finite
        parameters. The summary and a pending stop error wait for ``end_fit``.
        """
        self.began = True
        if not self.train_ended:
            self.train_ended = True
            # A collective: every rank reaches on_train_end.
            final_check(trainer, pl_module, self.registry.restorer, self.ledger, self.incidents, self.incidents.tried())
            for stages in self.parts.with_stage("train_end"):
                assert stages.train_end is not None
                stages.train_end(trainer, pl_module)

    def end_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The fit's end (the first member's ``teardown``; once): the state checked again, after every callback's
        ``on_train_end`` and ``on_fit_end`` and the LightningModule's (a weight-averaging callback copies its average
        into the model there, wherever it stands in the callback list), then the summary. Nothing in a fit runs
        later but the other callbacks' and the LightningModule's ``teardown``. ``leave`` raises a pending stop error.
        A fit whose training loop Lightning skipped (``max_steps=0``, ``limit_train_batches=0``, a resume at its end:
        no ``on_train_end``) gets its end-of-fit check here, and its summary ("no training step ran").
        """
        if self.fit_ended:
            return
        if not self.train_ended:
            fitting = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
            if not fitting:  # an evaluation's teardown (FP32Evaluation's), or a fit interrupted before training
                return
            self.train_end(trainer, pl_module)
        self.fit_ended = True
        if self.ledger.pending_error is None:  # a fit that stops with an error returns no model to check
            final_check(
                trainer,
                pl_module,
                self.registry.restorer,
                self.ledger,
                self.incidents,
                self.incidents.tried(),
                again=True,
            )
        self.finish(trainer, raise_pending=False)

    # ------------------------------------------------------------------ evaluation (the first member forwards it)
    def evaluation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step_name: str) -> None:
        parts = self.parts.with_stage("evaluation_start")
        if parts:
            self.began = True  # an evaluation ran: the summary is due at its end
        for stages in parts:
            assert stages.evaluation_start is not None
            stages.evaluation_start(trainer, pl_module, step_name)

    def evaluation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for stages in self.parts.with_stage("evaluation_epoch_end"):
            assert stages.evaluation_epoch_end is not None
            stages.evaluation_epoch_end(trainer, pl_module)

    def evaluation_end(self, trainer: pl.Trainer) -> None:
        """The evaluation loop ended: every part's ``evaluation_end``; the summary of a validate or test run."""
        parts = self.parts.with_stage("evaluation_end")
        for stages in parts:
            assert stages.evaluation_end is not None
            stages.evaluation_end(trainer)
        if parts and _evaluation_only(trainer):
            self.finish(trainer, raise_pending=False)

    def finish(self, trainer: pl.Trainer, *, raise_pending: bool) -> None:
        """Print the summary once, then raise a pending stop error (once). A fit refused at setup (nothing began,
        nothing recorded) prints none: the refusal is the message."""
        if not self.finished and (self.began or self.sink.records):
            self.finished = True
            quarantine = self.registry.quarantine
            notes = [*(quarantine.summary_lines() if quarantine is not None else []), *self.incidents.blames.lines]
            for source in self.registry.summary_notes:
                notes.extend(source())
            self.sink.summary(
                trainer,
                self.member_names,
                monitored=self.registry.monitors_steps or bool(self.registry.step_hooks),
                final_state=self.ledger.final_state,
                notes=notes,
                steps=trainer.global_step - self.first_step,
                # trainer.validate()/test()/predict(): the step monitors join fits only, and there is no step
                evaluation=_evaluation_only(trainer),
            )
        if raise_pending and self.ledger.pending_error is not None:
            error, self.ledger.pending_error = self.ledger.pending_error, None
            raise error


def _evaluation_only(trainer: pl.Trainer) -> str:
    """``"validate"``, ``"test"`` or ``"predict"`` when the Trainer runs that alone (no training step), else ``""``."""
    fn = trainer.state.fn
    return "" if fn is None or fn == TrainerFn.FITTING else str(fn.value)
