"""OptimizerBackoff: lower the learning rate so the scheduler keeps it lowered, raise eps where fp16 needs it."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._preflight import OnHazard, run_preflight
from lightning_nanguard.config import OptimizerBackoffConfig, arguments_from
from lightning_nanguard.contract import PassedOverSnapshots, StateRestored
from lightning_nanguard.engine import Engine
from lightning_nanguard.engine.incidents import EventHandled
from lightning_nanguard.policies.backoff import BackoffPolicy
from lightning_nanguard.recovery.backoff import eps_metrics
from lightning_nanguard.recovery.backoff_scales import BackoffResult, BackoffScales
from lightning_nanguard.reporting import keys

__all__ = ["OptimizerBackoff"]


@arguments_from(OptimizerBackoffConfig)
class OptimizerBackoff(NanGuardCallback):
    """Back off the learning rate (and Adam eps under fp16) when training diverges, so that the lowered rate persists.

    The engine's remedy policy decides *when* (README, "What happens when"), and only where a lower learning rate is
    the cause's remedy: a rollback for divergence (a gradient explosion, a spike handed to AutoRollback), a
    loss-scale collapse, or ``skips_before_backoff`` dropped updates of such a cause within ``skip_window`` steps.
    Bad data, a loss formula, a transient or unknown fault never lower it. eps alone is raised for optimizer
    numerics (finite gradients, non-finite update: Adam's eps underflowing in fp16). ``triggers`` lists which kinds
    may lower the learning rate. A rollback that passed over snapshots taken mid-divergence (see ``AutoRollback``)
    makes the backoff one ``lr_factor`` notch deeper for each: each would have met the divergence again.

    The learning rate is multiplied by ``lr_factor`` together with every anchor the schedulers recompute it from
    (``recovery/backoff.py``), so LambdaLR, OneCycleLR, CyclicLR, the cosine schedules, SWA and the rest keep it: the
    schedule becomes exactly ``scale`` times the configured one. Each param group and scheduler records the scale
    baked into it, so after anything restores an older optimizer/scheduler state (a rollback, ``fit(ckpt_path=...)``)
    or builds a new scheduler (StochasticWeightAveraging) the backoff is re-applied exactly once.

    eps backs off by ``eps_factor`` up to ``max_eps``. With ``eps_backoff="auto"`` it acts only on non-fused param
    groups holding float16 parameters (``precision="16-true"``): there eps lives in fp16, 1e-8 is 0 and Adam divides
    by zero. Under ``*-mixed`` the optimizer runs in float32 on float32 master weights and eps is not the problem;
    bfloat16 has float32's range. eps never recovers. Before the first step a preflight check (``on_hazard``) catches
    an eps that is not a normal number in the parameter dtype, a fused optimizer with GradScaler and clipping, and true
    half parameters without an fp32 master copy.

    Its arguments are declared once, in ``lightning_nanguard.config.OptimizerBackoffConfig`` (the "Args" below).

    Logged keys:
        ``nanguard/lr_scale``                    current learning-rate scale, logged steps
        ``nanguard/eps``                         current eps, when every group with an eps shares it, logged steps
        ``nanguard/eps/opt{i}_group{j}``         per group, when they differ
        ``nanguard/incident/backoff``, ``.../eps_backoff``   1.0 where an incident lowered the rate, raised eps
        ``nanguard/incident/fix``, ``.../preflight``   a preflight finding (fixed, or reported)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at train start, ``on_hazard="raise"`` and a hazard was found.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_nanguard import GradNormMonitor
        >>> trainer = Trainer(precision="16-true", callbacks=[GradNormMonitor(), OptimizerBackoff(recover_after=200)])
    """

    owner = "OptimizerBackoff"

    config: OptimizerBackoffConfig

    def __init__(
        self,
        lr_factor: float = 0.5,
        min_lr_scale: float = 0.01,
        triggers: str = "rollback,skip,loss_scale_collapse",
        skips_before_backoff: int = 3,
        skip_window: int = 100,
        recover_after: int | None = None,
        recover_steps: int = 1,
        recover_with_schedule: bool = False,
        eps_backoff: Literal["auto", "always", "never"] = "auto",
        eps_factor: float = 10.0,
        max_eps: float = 1e-2,
        on_hazard: OnHazard = "fix",
        safe_eps: float = 1e-4,
    ) -> None:
        self.config = c = OptimizerBackoffConfig.from_arguments(type(self).__name__, locals())
        self.triggers: frozenset[str] = c.trigger_set
        self._policy = BackoffPolicy(
            lr_factor=c.lr_factor,
            min_lr_scale=c.min_lr_scale,
            on=self.triggers,
            skips_before_backoff=c.skips_before_backoff,
            skip_window=c.skip_window,
            recover_after=c.recover_after,
            recover_steps=c.recover_steps,
            follow_schedule=c.recover_with_schedule,
        )
        self._scales = BackoffScales(self._policy, eps_mode=c.eps_backoff, eps_factor=c.eps_factor, max_eps=c.max_eps)
        self._state_loaded = False
        self._engine: Engine | None = None
        self._restored: int | None = None  # the step a rollback of the event being handled restored

    @property
    def lr_scale(self) -> float:
        """The current learning-rate scale (1.0 = the schedule as configured)."""
        return self._policy.scale

    @property
    def eps_scale(self) -> float:  # the factor eps backoff applied to the eps of its groups (capped at max_eps)
        return self._scales.eps_scale

    # ------------------------------------------------------------------ lifecycle
    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        engine.set_backoff(self)
        self._engine = engine
        engine.bus.subscribe(EventHandled, self._on_event)
        engine.bus.subscribe(StateRestored, self._on_restored)
        engine.bus.subscribe(PassedOverSnapshots, self._on_passed_over)
        self._scales.extra_notches = 0
        engine.add_metrics(self._metrics)
        engine.add_part(self)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._scales.stamp(trainer.optimizers, _schedulers(trainer))

    # ------------------------------------------------------------------ its part (engine/parts.py)
    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Optimizer and scheduler state are restored by now (on a resume too): check them, then re-apply.
        run_preflight(trainer, self.config.on_hazard, self.config.safe_eps, type(self).__name__)
        if not self._state_loaded:  # no callback state (added on resume): the scales the optimizer state holds
            self._scales.adopt(trainer.optimizers)
        self._sync(trainer)

    @property
    def engaged(self) -> bool:
        """Work at a batch start (a scheduler built mid-fit, the recoveries) only while the rate is backed off."""
        return self._policy.scale != 1.0 or self._policy.cap is not None

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> bool:
        """A scheduler built since (StochasticWeightAveraging's) gets the backoff; True: the batch end has work."""
        if self._policy.scale != 1.0 and self._scales.new_schedulers(_schedulers(trainer)):
            self._sync(trainer)
        return self.engaged

    def batch_end(self, trainer: pl.Trainer) -> None:
        if (
            self.config.recover_after is not None
            and self._policy.scale < 1.0
            and self._policy.tick(trainer.global_step)
        ):
            self._sync(trainer)  # a recovery notch
        elif self._policy.cap is not None and self._scales.follow(trainer.optimizers, _schedulers(trainer)):
            self._engaged_changed()  # the scale follows the schedule (recover_with_schedule)

    # ------------------------------------------------------------------ the engine's Backoff
    def eps_applies(self, trainer: pl.Trainer) -> bool:
        return self._scales.eps_applies(trainer.optimizers)

    def back_off(self, trainer: pl.Trainer, *, lr: bool, eps: bool, cause: str) -> BackoffResult:
        """Apply one backoff now (after the scheduler step)."""
        step, schedulers = trainer.global_step, _schedulers(trainer)
        engine, restored, self._restored = self._engine, self._restored, None
        reading = engine.last_reading if engine is not None else None
        ran_at = reading.lr if reading is not None else None  # the rate the step that spiked ran with
        restorer = engine.registry.restorer if engine is not None and restored is not None else None
        rates = restorer.rates_at(restored) if restorer is not None and restored is not None else None
        done = self._scales.back_off(
            trainer.optimizers, schedulers, step, lr=lr, eps=eps, cause=cause, ran_at=ran_at, restored=rates
        )
        self._engaged_changed()
        return done

    # ------------------------------------------------------------------ reactions (engine events only: rank-consistent)
    def _on_event(self, trainer: pl.Trainer, event: EventHandled) -> None:
        self._policy.last_event_step = max(self._policy.last_event_step, event.step)
        self._scales.extra_notches = 0  # the event is handled: its rollback's finding does not carry over
        self._restored = None

    def _on_passed_over(self, trainer: pl.Trainer, event: PassedOverSnapshots) -> None:  # before the event's backoff
        self._scales.extra_notches = len(event.passed_over)

    def _on_restored(self, trainer: pl.Trainer, event: StateRestored) -> None:
        self._restored = event.from_step
        self._sync(trainer)

    # ------------------------------------------------------------------ acting
    def _sync(self, trainer: pl.Trainer) -> None:
        """Bring every optimizer and scheduler to the current scales."""
        self._scales.sync(trainer.optimizers, _schedulers(trainer))
        self._engaged_changed()

    def _engaged_changed(self) -> None:
        """The rate may have been backed off or recovered: the engine re-reads ``engaged``."""
        if self._engine is not None:
            self._engine.refresh_batch_start()

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        return {keys.LR_SCALE: self._policy.scale, **eps_metrics(trainer.optimizers, keys.EPS)}

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, object]:
        return self._scales.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scales.load_state_dict(state_dict)
        self._state_loaded = True


def _schedulers(trainer: pl.Trainer) -> list[object]:
    return [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
