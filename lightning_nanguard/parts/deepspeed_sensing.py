"""The engine's reading of a step DeepSpeed took, after ``engine.step()``, turned into events.

DeepSpeed's engine owns the optimizer step (``signals/deepspeed.py`` has where and how), so the engine senses no step
in ``on_before_optimizer_step`` there: one ``StepReader`` per engine reads each step's outcome at the batch end
(``Registry.step_hooks``) for LossScaleWatchdog's and GradNormMonitor's watches. What it reads (the overflow flag,
the global grad norm, the loss scaler) DeepSpeed has already reduced, so every rank decides alike with no collective
of nanguard's own. An overflow or a collapse is an ``events.AfterStep`` handled by the incident path like any other
event (``callbacks/_deepspeed.py`` says what each callback does under DeepSpeed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_nanguard import _notices
from lightning_nanguard.contract import Action, Cause, Signal
from lightning_nanguard.engine.engine import Engine
from lightning_nanguard.engine.events import AfterStep, PendingEvent
from lightning_nanguard.policies.loss_scale import CollapsePolicy
from lightning_nanguard.policies.remedy import RemedyFacts
from lightning_nanguard.reporting import keys
from lightning_nanguard.signals import deepspeed as ds
from lightning_nanguard.signals.deepspeed import DeepSpeedScaler, StepOutcome, find_scaler, read_step
from lightning_nanguard.signals.loss_scale import ScaleHistory

__all__ = ["DeepSpeedGradWatch", "DeepSpeedScaleWatch", "ScaleSettings", "StepReader", "ds_engine", "step_reader"]

StepHandler = Callable[[pl.Trainer, StepOutcome], None]


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
        engine = ds_engine(trainer)
        if engine is None:
            return
        step = int(engine.global_steps)
        if step == self._last_step:
            return  # no optimizer step in this batch: DeepSpeed is accumulating gradients
        self._last_step = step
        outcome = read_step(engine)
        for handler in list(self.handlers.values()):
            handler(trainer, outcome)


def step_reader(engine: Engine) -> StepReader:
    """The engine's reader for this fit, hooked into the engine's batch end (a new one each fit). Found among the
    engine's own step hooks: a module-level map keyed by engine would keep the engine, and through the handlers'
    callbacks the Trainer, alive."""
    hooks = engine.registry.step_hooks
    for hook in hooks:
        reader = getattr(hook, "__self__", None)
        if isinstance(reader, StepReader):
            return reader
    reader = StepReader()
    hooks.append(reader.after_step)
    return reader


def _params_finite(trainer: pl.Trainer) -> bool | None:
    """Whether this rank's module parameters are finite (incident path only); ``None`` under ZeRO-3, whose
    parameters are partitioned away between steps. Replicated under ZeRO-1/2, so the same on every rank."""
    engine = ds_engine(trainer)
    if engine is None or int(engine.zero_optimization_stage()) >= 3:
        return None
    params = [p.detach() for p in engine.module.parameters() if p.numel()]
    if not params:
        return True
    return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def _ranks(trainer: pl.Trainer) -> tuple[int, ...]:
    """An incident's ranks: DeepSpeed reduces its overflow flag over the ranks before anyone sees it, so which rank
    overflowed is not known beyond one device (``()``)."""
    return (0,) if trainer.world_size == 1 else ()


def _step_of(trainer: pl.Trainer) -> int:
    return max(int(trainer.global_step) - 1, 0)  # the batch end: Lightning has counted the step already


# ---------------------------------------------------------------------- LossScaleWatchdog
@dataclass(frozen=True)
class ScaleSettings:
    """LossScaleWatchdog's choices, as the DeepSpeed watch needs them."""

    min_scale: float
    max_scale: float | None
    on_collapse: str
    max_collapses: int | None
    owns_collapse: bool  # a collapse rule is set: nanguard, not DeepSpeed's exception, ends a persistent overflow


class DeepSpeedScaleWatch:
    """LossScaleWatchdog's work under DeepSpeed (the watchdog's settings, policy and history; DeepSpeed's scaler)."""

    def __init__(self, settings: ScaleSettings, policy: CollapsePolicy, history: ScaleHistory, engine: Engine) -> None:
        self.settings = settings
        self.policy = policy
        self.history = history
        self.engine = engine
        self.active = True
        self.scaler: DeepSpeedScaler | None = None
        self._holder: object = None
        self._raised: dict[int, tuple[Any, bool]] = {}  # id(holder) -> (holder, its raise_error_at_min_scale)
        self._scale_ran: float | None = None
        self.floor = settings.min_scale

    def train_start(self, trainer: pl.Trainer) -> None:
        engine = ds_engine(trainer)
        self.scaler = find_scaler(getattr(engine, "optimizer", None)) if engine is not None else None
        if self.scaler is None:
            self.active = False
            _notices.note(
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
        self.floor = max(self.settings.min_scale, scaler.min_scale)  # DeepSpeed's own clamp holds its floor anyway
        if scaler.holder is not self._holder:
            self._holder = scaler.holder
            if self.settings.owns_collapse and scaler.kind == "zero" and id(scaler.holder) not in self._raised:
                self._raised[id(scaler.holder)] = (scaler.holder, scaler.raises_at_min)
                scaler.raises_at_min = False
        scaler.clamp(self.floor, self.settings.max_scale)

    def restore(self) -> None:
        """End of fit: give DeepSpeed back its own exit."""
        for holder, raised in self._raised.values():
            holder.raise_error_at_min_scale = raised
        self._raised.clear()
        self._holder = None

    def on_step(self, trainer: pl.Trainer, outcome: StepOutcome) -> None:
        if not self.active:
            return
        scaler = find_scaler(getattr(ds_engine(trainer), "optimizer", None))
        if scaler is None:
            return
        self.scaler = scaler
        scale = self._scale_ran if self._scale_ran is not None else scaler.scale
        self.history.note(_step_of(trainer), scale)
        collapsed = self.policy.observe(outcome.overflow, scale <= self.floor)
        self._adopt()  # floor the scale DeepSpeed just updated: the next step runs with it
        self._scale_ran = scaler.scale
        if collapsed:
            self._collapse(trainer, outcome, scale)

    def _collapse(self, trainer: pl.Trainer, outcome: StepOutcome, scale: float) -> None:
        policy, settings = self.policy, self.settings
        assert self.scaler is not None
        step = _step_of(trainer)
        weights_finite = _params_finite(trainer)
        collapse = policy.collapse(scale, self.floor, self.history.as_lists())
        narrate = functools.partial(
            ds.collapse_message,
            step=step,
            reason=collapse.reason,
            skipped_total=outcome.skipped_total,
            weights_finite=weights_finite,
            on_collapse=settings.on_collapse,
            collapses=policy.collapses,
            max_collapses=settings.max_collapses,
        )
        values = {
            **collapse.values,
            "deepspeed_min_loss_scale": self.scaler.min_scale,
            "deepspeed_skipped_steps": outcome.skipped_total,
            "weights_finite": weights_finite,
        }
        facts = RemedyFacts(
            Signal.LOSS_SCALE_COLLAPSE, on_collapse=settings.on_collapse, collapse_budget_left=collapse.budget_left
        )
        after = AfterStep(
            step,
            _ranks(trainer),
            facts,
            narrate,
            {Action.WARN: "LossScaleWatchdog", Action.STOP: "LossScaleWatchdog"},
            values,
            cause=Cause.CORRUPT_STATE if weights_finite is False else None,
            budget_left=collapse.budget_left,
        )
        self.engine.post(PendingEvent(Signal.LOSS_SCALE_COLLAPSE, [], after=after))

    def on_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """DeepSpeed's own exit, explained: an incident and a warning next to its bare message."""
        if not ds.is_min_scale_exit(exception):
            return
        scaler = self.scaler
        narrate = functools.partial(
            ds.exit_message,
            scale=None if scaler is None else scaler.scale,
            min_scale=None if scaler is None else scaler.min_scale,
        )
        after = AfterStep(
            _step_of(trainer),
            _ranks(trainer),
            RemedyFacts(Signal.LOSS_SCALE_COLLAPSE),
            narrate,
            {Action.STOP: "DeepSpeed"},
            {**self.policy.readings(), "deepspeed_error": str(exception)},
            exited=True,
        )
        self.engine.handle_now(trainer, PendingEvent(Signal.LOSS_SCALE_COLLAPSE, [], after=after))

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        policy = self.policy
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

    def __init__(
        self, engine: Engine, reader: StepReader, *, max_consecutive_skips: int, skipped_before: int, forced_check: bool
    ) -> None:
        self.engine = engine
        self.reader = reader
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_before = skipped_before  # updates dropped before this fit (restored from a checkpoint)
        self.forced_check = forced_check
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.grad_norm = math.nan
        self.grad_norm_max = -math.inf
        self.nonfinite_steps = 0

    def on_step(self, trainer: pl.Trainer, outcome: StepOutcome) -> None:
        ledger = self.engine.ledger
        if outcome.norm_known or outcome.overflow:  # supported setups always have one or the other
            if outcome.norm_known and not outcome.nonfinite:
                self.grad_norm = outcome.grad_norm
            self.grad_norm_max = max(self.grad_norm_max, outcome.grad_norm)
        if not outcome.overflow:
            ledger.skip_streak = 0
            return
        self.nonfinite_steps += 1
        ledger.skipped_steps += 1
        ledger.skip_streak += 1
        # A run of fp16 overflows is LossScaleWatchdog's to judge, against the loss scale.
        max_skips = None if self.reader.scale_watched else self.max_consecutive_skips
        step = _step_of(trainer)
        narrate = functools.partial(
            ds.overflow_message,
            step=step,
            skipped_total=outcome.skipped_total,
            forced_check=self.forced_check,
            streak=ledger.skip_streak,
            max_skips=self.max_consecutive_skips,
        )
        after = AfterStep(
            step,
            _ranks(trainer),
            RemedyFacts(Signal.NONFINITE_GRADS, skip_streak=ledger.skip_streak, max_consecutive_skips=max_skips),
            narrate,
            {Action.SCALER_SKIP: "DeepSpeed", Action.STOP: "GradNormMonitor"},
            {"grad_norm": math.inf, "deepspeed_skipped_steps": outcome.skipped_total, "update_applied": False},
        )
        self.engine.post(PendingEvent(Signal.NONFINITE_GRADS, [], after=after))

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        out: dict[str, float] = {
            keys.SKIPPED_STEPS: float(self.skipped_before + self.engine.ledger.skipped_steps),
            keys.NONFINITE_STEPS: float(self.nonfinite_steps),
        }
        if not math.isnan(self.grad_norm):
            out[keys.GRAD_NORM] = self.grad_norm
        if self.grad_norm_max > -math.inf:
            out[keys.GRAD_NORM_MAX] = self.grad_norm_max
        self._reset_interval()
        return out
