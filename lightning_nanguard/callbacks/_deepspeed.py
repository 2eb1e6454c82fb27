"""LossScaleWatchdog and GradNormMonitor under ``DeepSpeedStrategy``: they read DeepSpeed's own step after it.

DeepSpeed's engine owns the optimizer step (``signals/deepspeed.py`` has where and how), so under DeepSpeed the
nanguard engine does not sense steps in ``on_before_optimizer_step``: these watchers read the outcome of
``engine.step()`` at the batch end instead, through one ``StepReader`` per nanguard engine (one read per optimizer
step, shared by both callbacks; ``Engine.step_hooks``). What they read is DeepSpeed's reduced overflow flag and
global grad norm and its loss scaler, identical on every rank, so every rank takes the same decision without a
collective of nanguard's own.

What they can do, honestly:

* **LossScaleWatchdog** logs DeepSpeed's fp16 scale and its overflow skips under the usual ``nanguard/...`` keys,
  holds the scale in ``[min_scale, max_scale]`` after every step (a Python float: no device work), and takes the
  collapse decision over from DeepSpeed: with a collapse rule set it clears ZeRO's ``raise_error_at_min_scale``, so
  a persistent overflow ends in a nanguard incident and a stop (or a warning) that explains it, instead of
  DeepSpeed's bare "Current loss scale already at minimum ... Exiting run."; without a rule, that exit is explained
  where it happens (``on_exception``). A rollback is not available: AutoRollback does not support DeepSpeed.
* **GradNormMonitor** logs the engine's global grad norm and counts the steps DeepSpeed dropped because its own
  overflow check found inf/NaN gradients: always under fp16; under bf16 with ZeRO stage 1 or 2 the monitor turns
  that check on (``"bf16": {"check_grad_overflow": true}``), so DeepSpeed drops such an update itself. Nanguard
  cannot drop one: the update happens inside ``engine.step()``, after the last hook. Where DeepSpeed has no check
  (bf16/fp32 under ZeRO-3 or no ZeRO, fp32 under ZeRO-1/2) a non-finite step would go unseen, since ZeRO reports an
  inf/NaN norm as -1 per group, so the monitor refuses those setups (``require_overflow_check``). Under DeepSpeed
  ``on_nonfinite`` is therefore always a drop (by DeepSpeed), and spikes, per-layer norms, forensics and quarantine,
  which need the gradients before the update, are not available.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_nanguard import _lightning_compat
from lightning_nanguard.callbacks._common import make_incident
from lightning_nanguard.contract import Action, Cause, Signal
from lightning_nanguard.engine import Engine
from lightning_nanguard.exceptions import NonFiniteTrainingError, RecoveryBudgetExhausted, UnsupportedSetupError
from lightning_nanguard.reporting import keys
from lightning_nanguard.signals.deepspeed import (
    DeepSpeedScaler,
    StepOutcome,
    collapse_advice,
    find_scaler,
    is_min_scale_exit,
    min_scale_exit_explanation,
    read_step,
)

if TYPE_CHECKING:
    from lightning_nanguard.callbacks.grad_norm_monitor import GradNormMonitor
    from lightning_nanguard.callbacks.loss_scale_watchdog import LossScaleWatchdog

__all__ = ["DeepSpeedScaleWatch", "StepReader", "install_grad_watch", "is_deepspeed", "step_reader"]

StepHandler = Callable[[pl.Trainer, StepOutcome], None]


def is_deepspeed(trainer: pl.Trainer) -> bool:
    return "DeepSpeedStrategy" in _lightning_compat.strategy_class_names(trainer)


def ds_engine(trainer: pl.Trainer) -> Any | None:
    """The DeepSpeed engine (``None`` before ``strategy.setup`` created it)."""
    model = getattr(trainer.strategy, "model", None)
    return model if model is not None and hasattr(model, "was_step_applied") else None


class StepReader:
    """Reads ``engine.step()``'s outcome once per optimizer step and hands it to the watchers (at the batch end)."""

    def __init__(self) -> None:
        self.handlers: dict[str, StepHandler] = {}
        self.scale_watched = False  # LossScaleWatchdog watches a dynamic fp16 scale: overflow streaks are its call
        self._last_step: int | None = None

    def subscribe(self, owner: str, handler: StepHandler) -> None:
        self.handlers[owner] = handler

    def after_step(self, trainer: pl.Trainer) -> None:
        ds = ds_engine(trainer)
        if ds is None:
            return
        step = int(ds.global_steps)
        if step == self._last_step:
            return  # no optimizer step in this batch: DeepSpeed is accumulating gradients
        self._last_step = step
        outcome = read_step(ds)
        for handler in list(self.handlers.values()):
            handler(trainer, outcome)


def step_reader(engine: Engine) -> StepReader:
    """The engine's reader for this fit, hooked into the engine's batch end (a new one each fit). Found among the
    engine's own step hooks: a module-level map keyed by engine would keep the engine, and through the handlers'
    callbacks the Trainer, alive."""
    for hook in engine.step_hooks:
        reader = getattr(hook, "__self__", None)
        if isinstance(reader, StepReader):
            return reader
    reader = StepReader()
    engine.step_hooks.append(reader.after_step)
    return reader


def _params_finite(trainer: pl.Trainer) -> bool | None:
    """Whether this rank's module parameters are finite (incident path only); ``None`` under ZeRO-3, whose
    parameters are partitioned away between steps. Replicated under ZeRO-1/2, so the same on every rank."""
    ds = ds_engine(trainer)
    if ds is None or int(ds.zero_optimization_stage()) >= 3:
        return None
    params = [p.detach() for p in ds.module.parameters() if p.numel()]
    if not params:
        return True
    return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def _ranks(trainer: pl.Trainer) -> list[int]:
    """An incident's ranks: DeepSpeed reduces its overflow flag over the ranks before anyone sees it, so which rank
    overflowed is not known beyond one device (``[]``)."""
    return [0] if trainer.world_size == 1 else []


def _step_of(trainer: pl.Trainer) -> int:
    return max(int(trainer.global_step) - 1, 0)  # the batch end: Lightning has counted the step already


# ---------------------------------------------------------------------- LossScaleWatchdog
class DeepSpeedScaleWatch:
    """LossScaleWatchdog's work under DeepSpeed (the watchdog's settings and CollapsePolicy, DeepSpeed's scaler)."""

    def __init__(self, watchdog: LossScaleWatchdog, engine: Engine) -> None:
        self.watchdog = watchdog
        self.engine = engine
        self.active = True
        self.scaler: DeepSpeedScaler | None = None
        self._holder: Any = None
        self._raised: dict[int, tuple[Any, bool]] = {}  # id(holder) -> (holder, its raise_error_at_min_scale)
        self._scale_ran: float | None = None
        self.floor = watchdog.min_scale

    @property
    def owns_collapse(self) -> bool:
        """A collapse rule is set: nanguard, not DeepSpeed's exception, ends a persistent overflow."""
        return self.watchdog.floor_patience is not None or self.watchdog.max_overflow_streak is not None

    def train_start(self, trainer: pl.Trainer) -> None:
        ds = ds_engine(trainer)
        self.scaler = find_scaler(getattr(ds, "optimizer", None)) if ds is not None else None
        if self.scaler is None:
            self.active = False
            rank_zero_info(
                f"LossScaleWatchdog does nothing in this run: DeepSpeed uses no dynamic loss scale under precision "
                f"{trainer.precision!r} (only fp16 with 'loss_scale': 0, DeepSpeed's default, does)."
            )
            return
        self._adopt()
        self._scale_ran = self.scaler.scale
        step_reader(self.engine).scale_watched = True

    def _adopt(self) -> None:
        """Floor the (possibly new: a checkpoint load replaces ZeRO's scaler) scaler and take over its exit."""
        scaler = self.scaler
        assert scaler is not None
        wd = self.watchdog
        self.floor = max(wd.min_scale, scaler.min_scale)  # DeepSpeed's own clamp holds its min_loss_scale anyway
        if scaler.holder is not self._holder:
            self._holder = scaler.holder
            if self.owns_collapse and scaler.kind == "zero" and id(scaler.holder) not in self._raised:
                self._raised[id(scaler.holder)] = (scaler.holder, scaler.raises_at_min)
                scaler.raises_at_min = False
        scaler.clamp(self.floor, wd.max_scale)

    def restore(self) -> None:
        """End of fit: give DeepSpeed back its own exit."""
        for holder, raised in self._raised.values():
            holder.raise_error_at_min_scale = raised
        self._raised.clear()
        self._holder = None

    def on_step(self, trainer: pl.Trainer, outcome: StepOutcome) -> None:
        if not self.active:
            return
        ds = ds_engine(trainer)
        scaler = find_scaler(getattr(ds, "optimizer", None))
        if scaler is None:
            return
        self.scaler = scaler
        wd = self.watchdog
        scale = self._scale_ran if self._scale_ran is not None else scaler.scale
        wd._note_scale(_step_of(trainer), scale)
        collapsed = wd._policy.observe(outcome.overflow, scale <= self.floor)
        self._adopt()  # floor the scale DeepSpeed just updated: the next step runs with it
        self._scale_ran = scaler.scale
        if collapsed:
            self._collapse(trainer, outcome, scale)

    def _collapse(self, trainer: pl.Trainer, outcome: StepOutcome, scale: float) -> None:
        wd, policy = self.watchdog, self.watchdog._policy
        assert self.scaler is not None
        step = _step_of(trainer)
        weights_finite = _params_finite(trainer)
        over_budget = policy.budget_left <= 0
        warn = wd.on_collapse == "warn" and not over_budget
        reason = policy.reason.replace("at its floor", f"at its floor min_scale={self.floor:g}")
        if warn:
            then = "Kept training (on_collapse='warn'); DeepSpeed keeps skipping the overflowing updates."
        elif over_budget:
            then = f"Training stops: this is collapse {policy.collapses}, over max_collapses={wd.max_collapses}."
        else:
            then = (
                f"Training stops (on_collapse={wd.on_collapse!r}; a rollback is not available under DeepSpeed, whose "
                "optimizer state AutoRollback cannot restore)."
            )
        message = (
            f"nanguard: DeepSpeed's fp16 loss scale collapsed at step {step}: {reason}; DeepSpeed dropped each of "
            f"those updates itself (skipped_steps={outcome.skipped_total}). Without the watchdog DeepSpeed would "
            "have ended the run with 'Current loss scale already at minimum - cannot decrease scale anymore. "
            f"Exiting run.' {collapse_advice(weights_finite=weights_finite)} {then}"
        )
        values = {
            **policy.readings(),
            "loss_scale": scale,
            "min_scale": self.floor,
            "deepspeed_min_loss_scale": self.scaler.min_scale,
            "deepspeed_skipped_steps": outcome.skipped_total,
            "weights_finite": weights_finite,
            "scale_history": [[s, v] for s, v in wd.scale_history],
        }
        incident = make_incident(
            trainer,
            trigger=Signal.LOSS_SCALE_COLLAPSE.value,
            action=Action.WARN if warn else Action.STOP,
            source="LossScaleWatchdog",
            values=values,
            budget_left=policy.budget_left,
            message=message,
            step=step,
            cause=Cause.CORRUPT_STATE.value if weights_finite is False else "",
            ranks=_ranks(trainer),
        )
        self.engine.sink.record(trainer, incident)
        policy.reset_streaks()
        if warn:
            rank_zero_warn(message)
            return
        error = RecoveryBudgetExhausted if over_budget else NonFiniteTrainingError
        self.engine.request_stop(trainer, error(message))

    def on_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """DeepSpeed's own exit, explained: an incident and a warning next to its bare message."""
        if not is_min_scale_exit(exception):
            return
        scaler = self.scaler
        message = "nanguard: " + min_scale_exit_explanation(
            scale=None if scaler is None else scaler.scale, min_scale=None if scaler is None else scaler.min_scale
        )
        incident = make_incident(
            trainer,
            trigger=Signal.LOSS_SCALE_COLLAPSE.value,
            action=Action.STOP,
            source="DeepSpeed",
            values={**self.watchdog._policy.readings(), "deepspeed_error": str(exception)},
            message=message,
            step=_step_of(trainer),
            ranks=_ranks(trainer),
        )
        self.engine.sink.record(trainer, incident)
        rank_zero_warn(message)

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        policy = self.watchdog._policy
        out = {
            keys.OVERFLOW_STEPS: float(policy.overflow_steps),
            keys.OVERFLOW_RATE: policy.overflow_rate,
            keys.OVERFLOW_STREAK: float(policy.streak),
        }
        if self.active and self.scaler is not None:
            out[keys.LOSS_SCALE] = self.scaler.scale  # what the next step runs with (a host float)
        return out


# ---------------------------------------------------------------------- GradNormMonitor
class DeepSpeedGradWatch:
    """GradNormMonitor's work under DeepSpeed: the engine's global grad norm and overflow flag, after the step."""

    def __init__(self, monitor: GradNormMonitor, engine: Engine, reader: StepReader, forced_check: bool) -> None:
        self.forced_check = forced_check
        self.monitor = monitor
        self.engine = engine
        self.reader = reader
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.grad_norm = math.nan
        self.grad_norm_max = -math.inf
        self.nonfinite_steps = 0

    def on_step(self, trainer: pl.Trainer, outcome: StepOutcome) -> None:
        engine = self.engine
        if outcome.norm_known or outcome.overflow:  # supported setups always have one or the other
            if outcome.norm_known and not outcome.nonfinite:
                self.grad_norm = outcome.grad_norm
            self.grad_norm_max = max(self.grad_norm_max, outcome.grad_norm)
        if outcome.overflow:
            self.nonfinite_steps += 1
            engine.skipped_steps += 1
            engine.skip_streak += 1
            self._overflow(trainer, outcome)
        else:
            engine.skip_streak = 0

    def _overflow(self, trainer: pl.Trainer, outcome: StepOutcome) -> None:
        engine, monitor = self.engine, self.monitor
        step = _step_of(trainer)
        watchdog = self.reader.scale_watched
        too_many = engine.skip_streak > monitor.max_consecutive_skips and not watchdog
        message = (
            f"nanguard: step {step}: DeepSpeed found inf/NaN gradients and dropped the update itself (its overflow "
            f"check, all-reduced over the ranks; DeepSpeed's skipped_steps={outcome.skipped_total}); nanguard "
            "counted it."
        )
        if self.forced_check:
            message += " (DeepSpeed checks bf16 gradients because GradNormMonitor set its check_grad_overflow.)"
        action = Action.SCALER_SKIP
        if too_many:
            action = Action.STOP
            message += (
                f" That is {engine.skip_streak} dropped updates in a row (max_consecutive_skips="
                f"{monitor.max_consecutive_skips}): training stops. Under fp16 add LossScaleWatchdog, which judges "
                "overflow streaks against the loss scale; lower the learning rate or use precision='bf16-mixed'."
            )
        incident = make_incident(
            trainer,
            trigger=Signal.NONFINITE_GRADS.value,
            action=action,
            source="DeepSpeed" if not too_many else "GradNormMonitor",
            values={"grad_norm": math.inf, "deepspeed_skipped_steps": outcome.skipped_total, "update_applied": False},
            message=message,
            step=step,
            ranks=_ranks(trainer),
        )
        engine.sink.record(trainer, incident)
        if too_many:
            engine.request_stop(trainer, NonFiniteTrainingError(message))

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        out: dict[str, float] = {
            keys.SKIPPED_STEPS: float(self.monitor.skipped_steps),
            keys.NONFINITE_STEPS: float(self.nonfinite_steps),
        }
        if not math.isnan(self.grad_norm):
            out[keys.GRAD_NORM] = self.grad_norm
        if self.grad_norm_max > -math.inf:
            out[keys.GRAD_NORM_MAX] = self.grad_norm_max
        self._reset_interval()
        return out


def require_overflow_check(trainer: pl.Trainer) -> bool:
    """Make sure DeepSpeed checks every step's gradients for inf/NaN (and drops such an update itself); True when
    nanguard turned the check on. Raises ``UnsupportedSetupError`` where DeepSpeed has no such check.

    fp16 (any ZeRO stage, or none) always checks. bf16 under ZeRO stage 1 or 2 checks with the config's
    ``"bf16": {"check_grad_overflow": true}``, which is set here, before DeepSpeed reads the config (the callbacks'
    setup runs before the strategy's). Elsewhere (bf16 or fp32 under ZeRO-3 or no ZeRO; fp32 under ZeRO-1/2)
    DeepSpeed does not check, and its grad norm does not show a non-finite step either: ZeRO replaces an inf/NaN
    norm by -1 per parameter group (``mask_nan_or_inf_with_val_inplace``), so a NaN step reads as a norm of 1.0.
    """
    precision = str(trainer.precision)
    if precision in ("16-mixed", "16-true"):
        return False
    config = getattr(trainer.strategy, "config", None)
    config = config if isinstance(config, dict) else {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if precision in ("bf16-mixed", "bf16-true") and stage in (1, 2):
        bf16 = config.setdefault("bf16", {"enabled": True})
        if bf16.get("check_grad_overflow") is False:
            raise UnsupportedSetupError(
                'GradNormMonitor does not support DeepSpeedStrategy with "bf16": {"check_grad_overflow": false}: '
                "without DeepSpeed's check nothing sees or drops a non-finite bf16 step (see below). Remove that "
                "setting (GradNormMonitor turns the check on), or the callback."
            )
        forced = "check_grad_overflow" not in bf16
        bf16["check_grad_overflow"] = True
        return forced
    raise UnsupportedSetupError(
        f"GradNormMonitor does not support DeepSpeedStrategy under precision={precision!r} with ZeRO stage {stage}: "
        "there DeepSpeed neither checks the gradients for inf/NaN (it does under fp16, and under bf16 with ZeRO "
        "stage 1 or 2 with check_grad_overflow) nor reports a non-finite grad norm (ZeRO replaces an inf/NaN norm "
        "by -1 per parameter group; without ZeRO no norm is computed), and the update happens inside "
        "engine.step(), after the last hook: nanguard could neither see nor drop a non-finite step. Use "
        "precision='16-mixed', or bf16 with ZeRO stage 1 or 2, or remove the callback."
    )


def install_grad_watch(monitor: GradNormMonitor, trainer: pl.Trainer, engine: Engine) -> None:
    """GradNormMonitor's ``_install`` under DeepSpeed: read the engine's norm and overflow flag after each step."""
    if monitor.spike_zscore is not None:
        raise UnsupportedSetupError(
            "GradNormMonitor(spike_zscore=...) does not support DeepSpeedStrategy: a spike is judged before the "
            "update, and DeepSpeed's grad norm exists only after engine.step() has applied it. Remove spike_zscore, "
            "or the callback."
        )
    forced_check = require_overflow_check(trainer)
    reader = step_reader(engine)
    watch = DeepSpeedGradWatch(monitor, engine, reader, forced_check)
    reader.subscribe("GradNormMonitor", watch.on_step)
    engine.add_metrics(watch.metrics)
    rank_zero_info(
        "GradNormMonitor under DeepSpeed: logs DeepSpeed's global grad norm and counts its overflow skips; per-layer "
        "norms, forensics and quarantine need the gradients before the update and are off."
    )
