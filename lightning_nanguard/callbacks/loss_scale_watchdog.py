"""LossScaleWatchdog: the GradScaler's scale on the dashboard, a floor it lacks, and a collapse explained."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard._validation import check_choice, check_float, check_int
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._common import has_callback, make_incident
from lightning_nanguard.context import NanGuardContext, StepHealth, get_context
from lightning_nanguard.exceptions import (
    NanGuardConfigError,
    NonFiniteTrainingError,
    RecoveryBudgetExhausted,
    UnsupportedSetupError,
)
from lightning_nanguard.policies.loss_scale import CollapsePolicy, ScaleMirror, diagnose
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.reporting import keys
from lightning_nanguard.signals.loss_scale import scaler_schedule
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["LossScaleWatchdog"]

_log = logging.getLogger(__name__)

_HISTORY = 16  # (step, scale) pairs kept for the report: the last changes of the scale


class LossScaleWatchdog(NanGuardCallback):
    """Watch the GradScaler (``16-mixed``): log its scale and overflows, keep it above a floor, explain a collapse.

    ``torch.amp.GradScaler`` has no floor: a run whose steps keep overflowing halves the scale every step down to
    ``0.0``, silently. The watchdog clamps the scale into ``[min_scale, max_scale]`` right after every
    ``scaler.update()`` and treats a run that keeps overflowing as collapsed: ``max_overflow_streak`` overflowing
    steps in a row, or ``floor_patience`` overflows while the scale already sits at the floor (the GradScaler would
    have gone lower; counted until an overflow happens above the floor). The collapse is then reported with a
    diagnosis: *the loss is exploding* (overflows after finite steps: lower the LR, clip, bigger batch) or *the
    weights are already non-finite* (no finite step since resuming: the checkpoint is named), and the scale history.

    A step's overflow is the shared step health (``nanguard``'s one host read per step); the scale itself is
    followed on the host by replaying the GradScaler's deterministic schedule, and read from the device only on
    logging steps and after an overflow. With no GradScaler (``32-true``, ``bf16-mixed``, ``16-true``) the watchdog
    says so once at setup and does nothing.

    Args:
        min_scale: the floor (> 0), so the scale never reaches ``0.0``. Megatron and DeepSpeed default to 1.
        max_scale: an optional cap (``None``: the GradScaler's growth is unbounded).
        floor_patience: overflowing steps at the floor that make a collapse (``None``: not this rule).
        max_overflow_streak: consecutive overflowing steps that make a collapse (``None``: not this rule).
        on_collapse: ``"warn"`` keeps training (the GradScaler keeps skipping, as metaseq chose); ``"rollback"``
            drops the update and asks ``AutoRollback`` to restore the last good state; ``"stop"`` stops training
            with an error (fairseq, DeepSpeed).
        max_collapses: collapses handled by ``"warn"``/``"rollback"`` before one more stops training with
            ``RecoveryBudgetExhausted`` (``None``: unbounded).
        window: steps over which ``nanguard/overflow_rate`` is computed.

    Logged keys (every logging step):
        ``nanguard/loss_scale``         the scale the next step uses (after the floor and cap)
        ``nanguard/overflow_steps``     cumulative overflowing steps (across resumes)
        ``nanguard/overflow_rate``      fraction of overflowing steps over the last ``window`` steps
        ``nanguard/overflow_streak``    current run of consecutive overflowing steps
        ``nanguard/incident/<action>``  1.0 at a collapse (``warn``, ``rollback`` or ``stop``)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at setup, under a strategy that keeps its own loss scaler (DeepSpeed) or shards.
        NonFiniteTrainingError: at the end of training after a collapse with ``on_collapse="stop"`` (or
            ``"rollback"`` without ``AutoRollback``); ``RecoveryBudgetExhausted`` past ``max_collapses``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(precision="16-mixed", callbacks=[LossScaleWatchdog(min_scale=1.0, on_collapse="stop")])
    """

    def __init__(
        self,
        min_scale: float = 1.0,
        max_scale: float | None = None,
        floor_patience: int | None = 10,
        max_overflow_streak: int | None = 30,
        on_collapse: Literal["warn", "rollback", "stop"] = "stop",
        max_collapses: int | None = 3,
        window: int = 100,
    ) -> None:
        owner = type(self).__name__
        check_float(owner, "min_scale", min_scale, low=0.0, low_inclusive=False, high=3.0e38)
        check_float(owner, "max_scale", max_scale, low=0.0, low_inclusive=False, high=3.0e38, allow_none=True)
        if max_scale is not None and max_scale < min_scale:
            raise NanGuardConfigError(f"{owner}(max_scale={max_scale!r}): must be >= min_scale={min_scale!r} or None.")
        check_int(owner, "floor_patience", floor_patience, minimum=1, allow_none=True)
        check_int(owner, "max_overflow_streak", max_overflow_streak, minimum=1, allow_none=True)
        check_choice(owner, "on_collapse", on_collapse, ("warn", "rollback", "stop"))
        check_int(owner, "max_collapses", max_collapses, minimum=0, allow_none=True)
        check_int(owner, "window", window, minimum=1)
        self.min_scale = float(min_scale)
        self.max_scale = None if max_scale is None else float(max_scale)
        self.floor_patience = floor_patience
        self.max_overflow_streak = max_overflow_streak
        self.on_collapse = on_collapse
        self.max_collapses = max_collapses
        self.window = window
        self._policy = CollapsePolicy(on_collapse, floor_patience, max_overflow_streak, max_collapses, window)
        self._history: deque[tuple[int, float]] = deque(maxlen=_HISTORY)
        self._mirror: ScaleMirror | None = None
        self._pending: list[bool] = []  # overflow flags of the steps whose scaler.update() is not yet mirrored
        self._finite_steps = 0  # steps of this fit that did not overflow
        self._resumed_from: str | None = None
        self._active = False
        self._rollback_available = False

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(min_scale=self.min_scale, on_collapse=self.on_collapse)

    @property
    def scale_history(self) -> list[tuple[int, float]]:
        """The recent ``(global_step, scale)`` changes, oldest first (the scale a step starts with)."""
        return list(self._history)

    # ------------------------------------------------------------------ lifecycle
    @override
    def _check_environment(self, trainer: pl.Trainer) -> None:
        if "DeepSpeedStrategy" in _lightning_compat.strategy_class_names(trainer):
            raise UnsupportedSetupError(
                f"{type(self).__name__} does not support DeepSpeedStrategy: DeepSpeed keeps its own loss scaler "
                "inside its engine and exposes none to Lightning's precision plugin. Configure DeepSpeed's scaler "
                "instead (fp16: 'min_loss_scale', 'loss_scale_window', 'hysteresis'), or remove the callback."
            )
        super()._check_environment(trainer)

    @override
    def _setup_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: NanGuardContext) -> None:
        owner = type(self).__name__
        scaler = _lightning_compat.get_scaler(trainer)
        self._active = scaler is not None and bool(scaler.is_enabled())
        if not self._active:
            rank_zero_info(
                f"{owner} does nothing in this run: precision {trainer.precision!r} uses no GradScaler (only "
                "'16-mixed' does; bf16 and 32-bit need no loss scaling)."
            )
            return
        self._rollback_available = has_callback(trainer, "AutoRollback")
        if self.on_collapse == "rollback" and not self._rollback_available:
            rank_zero_warn(
                f"{owner}(on_collapse='rollback') hands a collapse to AutoRollback, which is not installed: a "
                "collapse will stop training instead. Add AutoRollback() to Trainer(callbacks=...), or choose "
                "on_collapse='warn' or 'stop'."
            )
        ctx.subscribe("restored", self._on_restored)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        # The scaler's state is restored from a checkpoint before this hook: one host read to start the mirror.
        scaler = _lightning_compat.get_scaler(trainer)
        _lightning_compat.clamp_scale(scaler, *self._bounds)
        scale, tracker = _lightning_compat.scaler_state(scaler)
        sched = scaler_schedule(scaler)
        self._mirror = ScaleMirror(
            scale, tracker, sched.growth_factor, sched.backoff_factor, sched.growth_interval, *self._bounds
        )
        self._mirror.clamp()
        self._pending.clear()
        self._finite_steps = 0
        self._resumed_from = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        self._note_scale(trainer.global_step)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._mirror is None:
            return
        health = get_context(trainer).step_health(trainer, pl_module, optimizer)
        overflow = health.bad
        at_floor = self._mirror.at_floor
        if overflow:
            at_floor = _distributed.any_rank(trainer, at_floor)  # ranks agree on the floor rule (overflow path only)
        else:
            self._finite_steps += 1
        self._pending.append(overflow)
        action = self._policy.observe(overflow, at_floor)
        if action is not Action.NONE:
            self._collapse(trainer, pl_module, optimizer, health, action)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._mirror is None or not self._pending:
            return  # no scaler.update() since the last batch end (accumulating micro-batch)
        scaler = _lightning_compat.get_scaler(trainer)
        _lightning_compat.clamp_scale(scaler, *self._bounds)  # on the device, no host read
        out = get_context(trainer).last_outcome(trainer)
        # A nanguard skip on a fused optimizer writes an inf into a gradient: the scaler backs off on a finite step.
        forced_inf = out is not None and out.step == trainer.global_step - 1 and out.how == "scaler_inf"
        logging = _lightning_compat.should_update_logs(trainer)
        overflow_path = any(self._pending) or forced_inf
        for bad in self._pending:
            predicted = self._mirror.update(bad)
        self._pending.clear()
        if overflow_path or logging:
            # One host read, only after an overflow (this rank's scaler may not have seen what the verdict saw) or
            # on a logging step (validates the mirror); the healthy path replays the schedule on the host.
            drifted = self._mirror.resync(*_lightning_compat.scaler_state(scaler))
            if drifted and not overflow_path:
                _log.debug("LossScaleWatchdog: the host mirror (%g) had drifted; re-synced.", predicted)
        self._note_scale(trainer.global_step)
        if logging:
            for name, value in (
                (keys.LOSS_SCALE, self._mirror.scale),
                (keys.OVERFLOW_STEPS, float(self._policy.overflow_steps)),
                (keys.OVERFLOW_RATE, self._policy.overflow_rate),
                (keys.OVERFLOW_STREAK, float(self._policy.streak)),
            ):
                pl_module.log(name, value, on_step=True, on_epoch=False)

    @override
    def _teardown_fit(self, trainer: pl.Trainer) -> None:
        self._mirror = None
        self._pending.clear()
        self._active = False

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        history = [[step, scale] for step, scale in self._history]
        return {"version": 1, **self._policy.state_dict(), "history": history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._policy.load_state_dict(state_dict)
        self._history = deque(((int(s), float(v)) for s, v in state_dict.get("history", [])), maxlen=_HISTORY)

    # ------------------------------------------------------------------ internals
    @property
    def _bounds(self) -> tuple[float, float | None]:
        return self.min_scale, self.max_scale

    def _note_scale(self, step: int) -> None:
        assert self._mirror is not None
        if not self._history or self._history[-1][1] != self._mirror.scale:
            self._history.append((step, self._mirror.scale))

    def _on_restored(self, trainer: pl.Trainer, **payload: Any) -> None:
        """A rollback restored the scaler too: keep the floor, re-read the scale, count afresh."""
        if self._mirror is None:
            return
        scaler = _lightning_compat.get_scaler(trainer)
        _lightning_compat.clamp_scale(scaler, *self._bounds)
        self._mirror.resync(*_lightning_compat.scaler_state(scaler))
        self._policy.reset_streaks()
        self._note_scale(trainer.global_step)

    def _collapse(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Optimizer,
        health: StepHealth,
        action: Action,
    ) -> None:
        """Act on a collapse. Every rank runs this at the same step (its inputs were agreed across ranks)."""
        assert self._mirror is not None
        ctx, owner = get_context(trainer), type(self).__name__
        if action is Action.ROLLBACK and not self._rollback_available:
            action = Action.STOP
        if action is not Action.WARN:
            ctx.skip_step(trainer, optimizer, health, owner)  # it overflowed: the GradScaler drops it; counted once
        weights_finite = not _distributed.any_rank(trainer, ~all_finite(list(pl_module.parameters()), wide=True))
        diagnosis = diagnose(
            weights_finite=weights_finite, finite_steps=self._finite_steps, resumed_from=self._resumed_from
        )
        p = self._policy
        message = p.describe(
            action,
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            scale=self._mirror.scale,
            min_scale=self.min_scale,
            history=self._history,
            advice=diagnosis.advice,
        )
        values = {
            **health.values(),
            "loss_scale": self._mirror.scale,
            "min_scale": self.min_scale,
            **p.readings(),
            "weights_finite": weights_finite,
            "diagnosis": diagnosis.kind,
            "resumed_from": self._resumed_from or "",
            "scale_history": [[s, v] for s, v in self._history],
        }
        incident = make_incident(
            trainer,
            trigger="loss_scale_collapse",
            action=action,
            source=owner,
            ranks=health.bad_ranks(trainer),
            values=values,
            budget_left=p.budget_left,
            message=message,
        )
        if action is Action.ROLLBACK:
            ctx.request(trainer, "rollback", trigger="loss_scale_collapse", source=owner)
        ctx.record(trainer, incident)
        if action is Action.WARN:
            rank_zero_warn(message)
        elif action is Action.STOP:
            error_type = RecoveryBudgetExhausted if p.budget_exhausted else NonFiniteTrainingError
            ctx.request_stop(trainer, error_type(message))
        p.reset_streaks()
