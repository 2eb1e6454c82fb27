"""OptimizerBackoff: lower the learning rate so the scheduler keeps it lowered, raise eps where fp16 needs it."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard import _lightning_compat
from lightning_nanguard._validation import check_choice, check_float, check_int
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._common import make_incident
from lightning_nanguard.callbacks._preflight import OnHazard, run_preflight
from lightning_nanguard.context import NanGuardContext, get_context
from lightning_nanguard.exceptions import NanGuardConfigError
from lightning_nanguard.policies.backoff import BackoffPolicy, ScaleChange, parse_triggers
from lightning_nanguard.recovery.backoff import (
    EPS_SCALE_KEY,
    eps_groups,
    eps_metrics,
    lr_scale_of,
    stamp_lr_scale,
    sync_eps_scale,
    sync_lr_scale,
)
from lightning_nanguard.reporting import emit, keys
from lightning_nanguard.reporting.incidents import Incident

__all__ = ["OptimizerBackoff"]


class OptimizerBackoff(NanGuardCallback):
    """Back off the learning rate (and Adam eps under fp16) after incidents, so that the lowered rate persists.

    The learning rate is multiplied by ``lr_factor`` together with every anchor the schedulers recompute it from
    (``base_lrs``, ``initial_lr``/``max_lr``/``min_lr``, ``max_lrs``, ``eta_min``, ``min_lrs``, composite schedulers
    included), so LambdaLR, OneCycleLR, CyclicLR, the cosine schedules and the rest keep it: the schedule becomes
    exactly ``scale`` times the configured one. The change is applied in ``on_train_batch_end``, after Lightning
    stepped the scheduler; an incident that arrives earlier in the step is deferred to it. Each param group and
    scheduler records the scale baked into it, and the recording travels with their state, so after anything
    restores an older optimizer/scheduler state (AutoRollback's ``"restored"`` event, ``fit(ckpt_path=...)``) the
    backoff is re-applied exactly once.

    eps backs off with every learning-rate backoff (same triggers), by ``eps_factor`` up to ``max_eps``. With
    ``eps_backoff="auto"`` it acts only on non-fused param groups holding float16 parameters
    (``precision="16-true"``): there eps lives in fp16, 1e-8 is 0 and Adam divides by zero. Under ``*-mixed`` the
    optimizer runs in float32 on float32 master weights and eps is not the problem, so it is left alone; bfloat16 has
    float32's range. eps never recovers. Before the first step a preflight check (``on_hazard``) catches an eps that is
    not a normal number in the parameter dtype, a fused optimizer with GradScaler and clipping, and true half
    parameters without an fp32 master copy.

    Args:
        lr_factor: multiply the learning-rate scale by this at each backoff, in (0, 1).
        min_lr_scale: floor of the scale (relative to the configured schedule), in (0, 1].
        triggers: comma list of incident kinds that cause a backoff: ``rollback`` (AutoRollback), ``skip`` (a dropped
            update, e.g. GradNormMonitor), ``scaler_skip`` (a GradScaler skip), ``loss_scale_collapse``
            (LossScaleWatchdog), ``warn``, ``stop``.
        skips_before_backoff: skip incidents needed within ``skip_window`` optimizer steps for one backoff.
        skip_window: the window for counting skips, in optimizer steps.
        recover_after: healthy optimizer steps before the scale climbs one notch back toward 1.0; ``None``: never.
        recover_steps: notches per backoff level (each multiplies the scale by ``(1/lr_factor) ** (1/recover_steps)``).
        eps_backoff: ``"auto"`` (fp16 non-fused groups), ``"always"`` (every group with an eps) or ``"never"``.
        eps_factor: multiply eps by this at each backoff, > 1.
        max_eps: eps is never raised above this.
        on_hazard: preflight: ``"fix"`` raises an underflowing eps to ``safe_eps`` and warns; ``"warn"`` only warns;
            ``"raise"`` raises ``UnsupportedSetupError``; ``"off"`` skips the checks.
        safe_eps: the eps a preflight fix sets (at least the dtype's smallest normal number).

    Logged keys:
        ``nanguard/lr_scale``                    the learning-rate scale (1.0 = as configured), logged steps
        ``nanguard/eps``                         eps when every group with an eps shares it, logged steps
        ``nanguard/eps/opt{i}_group{j}``         per group, when they differ
        ``nanguard/incident/backoff``            1.0 at a backoff, recovery or re-application
        ``nanguard/incident/fix``, ``.../preflight``   a preflight finding (fixed, or reported)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at train start, ``on_hazard="raise"`` and a hazard was found.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_nanguard import GradNormMonitor
        >>> trainer = Trainer(precision="16-true", callbacks=[GradNormMonitor(), OptimizerBackoff(recover_after=200)])
    """

    def __init__(
        self,
        lr_factor: float = 0.5,
        min_lr_scale: float = 0.01,
        triggers: str = "rollback,skip,loss_scale_collapse",
        skips_before_backoff: int = 3,
        skip_window: int = 100,
        recover_after: int | None = None,
        recover_steps: int = 1,
        eps_backoff: Literal["auto", "always", "never"] = "auto",
        eps_factor: float = 10.0,
        max_eps: float = 1e-2,
        on_hazard: OnHazard = "fix",
        safe_eps: float = 1e-4,
    ) -> None:
        owner = type(self).__name__
        check_float(owner, "lr_factor", lr_factor, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        check_float(owner, "min_lr_scale", min_lr_scale, low=0.0, high=1.0, low_inclusive=False)
        if not isinstance(triggers, str):
            raise NanGuardConfigError(
                f"{owner}(triggers={triggers!r}): must be a comma-separated string of trigger names."
            )
        try:
            trigger_set = parse_triggers(triggers)
        except ValueError as err:
            raise NanGuardConfigError(f"{owner}(triggers={triggers!r}): {err}.") from None
        check_int(owner, "skips_before_backoff", skips_before_backoff, minimum=1)
        check_int(owner, "skip_window", skip_window, minimum=1)
        check_int(owner, "recover_after", recover_after, minimum=1, allow_none=True)
        check_int(owner, "recover_steps", recover_steps, minimum=1)
        check_choice(owner, "eps_backoff", eps_backoff, ("auto", "always", "never"))
        check_float(owner, "eps_factor", eps_factor, low=1.0, high=1e6, low_inclusive=False)
        check_float(owner, "max_eps", max_eps, low=0.0, high=1.0, low_inclusive=False)
        check_choice(owner, "on_hazard", on_hazard, ("fix", "warn", "raise", "off"))
        check_float(owner, "safe_eps", safe_eps, low=0.0, high=1.0, low_inclusive=False)
        self.lr_factor, self.min_lr_scale, self.triggers = float(lr_factor), float(min_lr_scale), triggers
        self.skips_before_backoff, self.skip_window = skips_before_backoff, skip_window
        self.recover_after, self.recover_steps = recover_after, recover_steps
        self.eps_backoff, self.eps_factor, self.max_eps = eps_backoff, float(eps_factor), float(max_eps)
        self.on_hazard, self.safe_eps = on_hazard, float(safe_eps)
        self._policy = BackoffPolicy(
            lr_factor=self.lr_factor,
            min_lr_scale=self.min_lr_scale,
            on=trigger_set,
            skips_before_backoff=skips_before_backoff,
            skip_window=skip_window,
            recover_after=recover_after,
            recover_steps=recover_steps,
        )
        self._eps_scale = 1.0
        self._pending: list[ScaleChange] = []
        self._restored = False
        self._in_batch = False
        self._at_batch_end = False  # between our on_train_batch_end and the next batch: global_step already moved
        self._state_loaded = False
        self._last_tick = -1

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(lr_factor=self.lr_factor, triggers=self.triggers)

    @property
    def lr_scale(self) -> float:
        """The current learning-rate scale (1.0 = the schedule as configured)."""
        return self._policy.scale

    @property
    def eps_scale(self) -> float:
        """The factor eps backoff has applied to the eps of the groups it acts on (capped at ``max_eps``)."""
        return self._eps_scale

    # ------------------------------------------------------------------ lifecycle
    @override
    def _setup_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: NanGuardContext) -> None:
        ctx.subscribe("incident", self._on_incident)
        ctx.subscribe("restored", self._on_restored)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Record scale 1.0 in every fresh optimizer/scheduler before anyone snapshots them: a scheduler restore is
        # ``__dict__.update`` and cannot drop a record its saved state lacks (see ``stamp_lr_scale``).
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        for opt in trainer.optimizers:
            stamp_lr_scale(opt, schedulers)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Optimizer and scheduler state are restored by now (on a resume too): check them, then re-apply.
        run_preflight(trainer, self.on_hazard, self.safe_eps, type(self).__name__)
        if not self._state_loaded and trainer.optimizers:
            # No callback state (added on resume): adopt the scale the optimizer state says was baked in.
            self._policy.scale = lr_scale_of(trainer.optimizers[0])
            groups = eps_groups(trainer.optimizers, self.eps_backoff)
            if groups:
                self._eps_scale = float(groups[0][2].get(EPS_SCALE_KEY, 1.0))
        self._at_batch_end = False
        self._apply(trainer, [], trigger="reapplied_after_resume")
        self._last_tick = trainer.global_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._in_batch, self._at_batch_end = True, False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning has stepped the step/epoch schedulers by now: from here on a change is not undone this step.
        self._in_batch, self._at_batch_end = False, True
        changes, self._pending = self._pending, []
        if changes or self._restored:
            self._restored = False
            self._apply(trainer, changes, trigger="reapplied_after_restore")
        if trainer.global_step != self._last_tick:
            self._last_tick = trainer.global_step
            change = self._policy.tick(trainer.global_step)
            if change is not None:
                self._apply(trainer, [change])
        if _lightning_compat.should_update_logs(trainer):
            # Host floats already: one logger call, no tensors, no per-key ``self.log`` overhead (~2 ms each).
            emit.log_event(trainer, {keys.LR_SCALE: self._policy.scale, **eps_metrics(trainer.optimizers, keys.EPS)})

    @override
    def _teardown_fit(self, trainer: pl.Trainer) -> None:
        self._in_batch, self._pending, self._restored = False, [], False

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        p = self._policy
        return {
            "version": 1,
            "lr_scale": p.scale,
            "eps_scale": self._eps_scale,
            "backoffs": p.backoffs,
            "last_event_step": p.last_event_step,
            "skip_steps": list(p.skip_steps),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        p = self._policy
        p.scale = float(state_dict.get("lr_scale", 1.0))
        self._eps_scale = float(state_dict.get("eps_scale", 1.0))
        p.backoffs = int(state_dict.get("backoffs", 0))
        p.last_event_step = int(state_dict.get("last_event_step", -1))
        p.skip_steps = [int(s) for s in state_dict.get("skip_steps", [])]
        self._state_loaded = True

    # ------------------------------------------------------------------ reactions
    def _on_incident(self, trainer: pl.Trainer, incident: Incident) -> None:
        if incident.source == type(self).__name__:
            return
        change = self._policy.observe(incident.action, incident.trigger, incident.step)
        if change is None:
            return
        if self._in_batch:
            self._pending.append(change)  # the scheduler has not stepped yet: wait for on_train_batch_end
        else:
            self._apply(trainer, [change])

    def _on_restored(self, trainer: pl.Trainer, **payload: Any) -> None:
        if self._in_batch:
            self._restored = True
        else:
            self._apply(trainer, [], trigger="reapplied_after_restore")

    # ------------------------------------------------------------------ acting
    def _apply(self, trainer: pl.Trainer, changes: list[ScaleChange], trigger: str = "") -> None:
        """Raise/lower ``_eps_scale`` for the changes, then sync every optimizer to the scales; record what changed."""
        targets = eps_groups(trainer.optimizers, self.eps_backoff)
        if any(c.eps for c in changes) and any(float(g["eps"]) < self.max_eps for _, _, g in targets):
            self._eps_scale *= self.eps_factor
        lr_before = [lr_scale_of(opt) for opt in trainer.optimizers]
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        changed = False
        for opt in trainer.optimizers:
            changed |= sync_lr_scale(opt, schedulers, self._policy.scale)
        eps_before, eps_after = {}, {}
        for i, j, group in targets:
            moved = sync_eps_scale(group, self._eps_scale, self.max_eps)
            if moved is not None:
                eps_before[f"opt{i}_group{j}"], eps_after[f"opt{i}_group{j}"] = moved
        if not (changes or changed or eps_after):
            return
        cause = changes[-1].cause if changes else trigger
        values: dict[str, Any] = {
            "lr_scale_before": changes[0].before if changes else min(lr_before, default=1.0),
            "lr_scale_after": self._policy.scale,
        }
        if eps_after:
            values.update(eps_before=eps_before, eps_after=eps_after)
        at_floor = bool(changes) and changes[-1].cause != "recovery" and changes[0].before == self._policy.scale
        message = (
            f"learning-rate scale {values['lr_scale_before']:g} -> {self._policy.scale:g} ({cause})"
            + (f", eps {eps_before} -> {eps_after}" if eps_after else "")
            + (f"; at the floor min_lr_scale={self.min_lr_scale:g}, no further backoff" if at_floor else "")
            + "."
        )
        # Applied in on_train_batch_end, a change follows the step that just ran (global_step has moved on).
        step = trainer.global_step - 1 if self._at_batch_end else trainer.global_step
        incident = make_incident(
            trainer, trigger=cause, action="backoff", source=type(self).__name__, values=values, message=message
        )
        get_context(trainer).record(trainer, dataclasses.replace(incident, step=max(step, 0)))
