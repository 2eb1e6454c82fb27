"""LossScaleWatchdog: the loss scale on the dashboard, a floor it lacks, and a collapse met by a remedy.

The GradScaler (``16-mixed``) is watched through the engine's step reading; DeepSpeed's own fp16 loss scaler
(``DeepSpeedStrategy``) after DeepSpeed's step, by ``parts/deepspeed_sensing.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard import _lightning_compat, _notices
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._deepspeed import install_scale_watch, is_deepspeed
from lightning_nanguard.config import LossScaleWatchdogConfig, arguments_from
from lightning_nanguard.contract import StateRestored
from lightning_nanguard.engine import Engine, get_engine
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.parts.deepspeed_sensing import DeepSpeedScaleWatch, ScaleSettings
from lightning_nanguard.policies.loss_scale import CollapseFacts, CollapsePolicy
from lightning_nanguard.reporting import keys
from lightning_nanguard.signals.loss_scale import ScaleHistory

__all__ = ["LossScaleWatchdog"]


@arguments_from(LossScaleWatchdogConfig)
class LossScaleWatchdog(NanGuardCallback):
    """Watch the GradScaler (``16-mixed``): log its scale and overflows, keep it above a floor, meet a collapse.

    ``torch.amp.GradScaler`` has no floor: a run whose steps keep overflowing halves the scale every step down to
    ``0.0``, silently. The watchdog clamps the scale into ``[min_scale, max_scale]`` on the device right after every
    ``scaler.update()`` (no host read) and treats a run that keeps overflowing as collapsed: ``max_overflow_streak``
    overflowing steps in a row, or ``floor_patience`` overflows while the scale already sits at the floor.

    A collapse is an incident with a diagnosis from the engine (the loss is exploding; the weights are already
    non-finite, e.g. loaded that way from the checkpoint the run resumed from, which is named). With
    ``on_collapse="auto"`` (default) it is rolled back and the learning rate lowered when AutoRollback (and
    OptimizerBackoff) are installed, and training stops otherwise; ``"rollback"``, ``"warn"`` (keep skipping, as
    metaseq chose) and ``"stop"`` force a choice. The scale and the overflow flag reach the host with the step's one
    reading; with no GradScaler (``32-true``, ``bf16-mixed``, ``16-true``) the watchdog says so once and does
    nothing.

    Under ``DeepSpeedStrategy`` (fp16) the watchdog watches DeepSpeed's own dynamic loss scaler instead, read after
    each ``engine.step()``: the same keys are logged, the scale is held in ``[min_scale, max_scale]`` (never below
    DeepSpeed's own ``min_loss_scale``), and an overflow is DeepSpeed's own skip (its flag is all-reduced by
    DeepSpeed, so every rank decides alike). With a collapse rule set the watchdog takes the collapse decision over
    from DeepSpeed, whose ZeRO scaler would otherwise end the run with "Current loss scale already at minimum -
    cannot decrease scale anymore. Exiting run.": the collapse is an incident that explains it, then a stop (no
    rollback under DeepSpeed) or, with ``on_collapse="warn"``, a warning. With both rules off DeepSpeed keeps its
    exit, and the watchdog explains it when it happens.

    Its arguments are declared once, in ``lightning_nanguard.config.LossScaleWatchdogConfig`` (the "Args" below).

    Logged keys (every logging step):
        ``nanguard/loss_scale``         the scale the last step ran with
        ``nanguard/overflow_steps``     cumulative overflowing steps (across resumes)
        ``nanguard/overflow_rate``      fraction of overflowing steps over the last ``window`` steps
        ``nanguard/overflow_streak``    current run of consecutive overflowing steps
        ``nanguard/incident/<action>``  1.0 at a collapse (``rollback``, ``warn`` or ``stop``)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at setup, under a strategy it does not support (``callbacks/_common.py``).
        NonFiniteTrainingError / RecoveryBudgetExhausted: at the end of training, when a collapse stopped it.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(precision="16-mixed", callbacks=[LossScaleWatchdog(min_scale=1.0)])
    """

    owner = "LossScaleWatchdog"

    config: LossScaleWatchdogConfig

    def __init__(
        self,
        min_scale: float = 1.0,
        max_scale: float | None = None,
        floor_patience: int | None = 10,
        max_overflow_streak: int | None = 30,
        on_collapse: Literal["auto", "warn", "rollback", "stop"] = "auto",
        max_collapses: int | None = 3,
        window: int = 100,
    ) -> None:
        self.config = c = LossScaleWatchdogConfig.from_arguments(type(self).__name__, locals())
        self._policy = CollapsePolicy(c.floor_patience, c.max_overflow_streak, c.max_collapses, c.window)
        self._history = ScaleHistory()  # the last changes of the scale, for a collapse's record
        self._active = False
        self._deepspeed: DeepSpeedScaleWatch | None = None

    @property
    def scale_history(self) -> list[tuple[int, float]]:
        """The recent ``(global_step, scale)`` changes, oldest first (the scale a step ran with)."""
        return list(self._history.changes)

    # ------------------------------------------------------------------ lifecycle
    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        engine.add_part(self)
        # Each fit its own counts (a callback reused by another Trainer); a resume's load_state_dict comes after.
        self._policy = CollapsePolicy(
            self.config.floor_patience, self.config.max_overflow_streak, self.config.max_collapses, self.config.window
        )
        self._history = ScaleHistory()
        if is_deepspeed(trainer):
            # DeepSpeed's engine owns the scaler and the step: watched after it (the scaler exists from train start).
            self._active = True
            rules = self.config.floor_patience is not None or self.config.max_overflow_streak is not None
            settings = ScaleSettings(
                self.config.min_scale, self.config.max_scale, self.config.on_collapse, self.config.max_collapses, rules
            )
            self._deepspeed = install_scale_watch(engine, settings, self._policy, self._history)
            return
        scaler = _lightning_compat.get_scaler(trainer)
        self._active = scaler is not None and bool(scaler.is_enabled())
        if not self._active:
            _notices.note(
                f"{type(self).__name__} does nothing in this run: precision {trainer.precision!r} uses no GradScaler "
                "(only '16-mixed' does; bf16 and 32-bit need no loss scaling)."
            )
            return
        engine.set_scale_watch(self)
        engine.bus.subscribe(StateRestored, self._on_restored)
        engine.add_metrics(self._metrics)

    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Its part's (engine/parts.py): DeepSpeed's scaler taken over, or the restored scale held to the floor."""
        if self._deepspeed is not None:
            self._deepspeed.train_start(trainer)
            self._active = self._deepspeed.active
        elif self._active:
            # The scaler's state is restored from a checkpoint before this hook: hold it to the floor from step 1.
            _lightning_compat.clamp_scale(
                _lightning_compat.get_scaler(trainer), self.config.min_scale, self.config.max_scale
            )
            if self.config.on_collapse == "rollback" and get_engine(trainer).restorer is None:
                _notices.warn(
                    f"{type(self).__name__}(on_collapse='rollback') hands a collapse to AutoRollback, which is not "
                    "installed: a collapse will stop training instead. Add AutoRollback(), or use on_collapse='auto'."
                )

    @override
    def _uninstall(self, trainer: pl.Trainer) -> None:
        self._active = False
        if self._deepspeed is not None:
            self._deepspeed.restore()
            self._deepspeed = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._deepspeed is not None:
            self._deepspeed.on_exception(trainer, exception)
            self._deepspeed.restore()
        super().on_exception(trainer, pl_module, exception)

    # ------------------------------------------------------------------ the engine's ScaleWatch
    def observe(self, trainer: pl.Trainer, reading: Reading) -> CollapseFacts | None:
        scale = reading.scale
        assert scale is not None
        self._history.note(reading.step, scale)
        at_floor = scale <= self.config.min_scale  # identical on every rank: the scale came with the reduced reading
        if not self._policy.observe(reading.bad, at_floor):
            return None
        return self._policy.collapse(scale, self.config.min_scale, self._history.as_lists())

    def collapses_left(self) -> int | None:
        """Further collapses the budget allows (``None``: unlimited)."""
        return self._policy.collapses_left()

    def after_step(self, trainer: pl.Trainer, readings: Sequence[Reading] = ()) -> None:
        """Hold the scale in ``[min_scale, max_scale]``: on the device, no host read. Nothing to do (no device op)
        where ``readings``, this batch's, show that the scaler's update cannot have left the range."""
        scaler = _lightning_compat.get_scaler(trainer)
        if readings and self._update_stays_in_range(scaler, readings[-1].scale):
            return
        _lightning_compat.clamp_scale(scaler, self.config.min_scale, self.config.max_scale)

    def _update_stays_in_range(self, scaler: object, ran_with: float | None) -> bool:
        """The scale after the scaler's update of a step that ran with ``ran_with`` is within ``[ran_with *
        backoff_factor, ran_with * growth_factor]``: inside the range, nothing can need clamping."""
        grow, back = _lightning_compat.scaler_factors(scaler)
        if ran_with is None or grow is None or back is None:
            return False
        return ran_with * back >= self.config.min_scale and (
            self.config.max_scale is None or ran_with * grow <= self.config.max_scale
        )

    def _on_restored(self, trainer: pl.Trainer, event: StateRestored) -> None:
        """A rollback restored the state: keep the floor, count afresh."""
        self.after_step(trainer)
        self._policy.reset_streaks()

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        out = {
            keys.OVERFLOW_STEPS: float(self._policy.overflow_steps),
            keys.OVERFLOW_RATE: self._policy.overflow_rate,
            keys.OVERFLOW_STREAK: float(self._policy.streak),
        }
        scaler = _lightning_compat.get_scaler(trainer)
        if scaler is not None and self._history.last is not None:
            # The scale after this step's update (what the next step runs with): one host read per logging step.
            out[keys.LOSS_SCALE] = float(scaler.get_scale())
        return out

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, object]:
        return {"version": 2, **self._policy.state_dict(), "history": self._history.as_lists()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._policy.load_state_dict(state_dict)
        self._history.load(state_dict.get("history", []))
