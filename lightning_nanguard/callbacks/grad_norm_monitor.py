"""GradNormMonitor: the gradient norm on the dashboard, and a non-finite update stopped before it lands."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nanguard import _lightning_compat
from lightning_nanguard._validation import check_choice, check_float, check_int
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._common import has_callback, incident_from_health, make_incident
from lightning_nanguard.callbacks._spike import SpikeWatch
from lightning_nanguard.context import NanGuardContext, get_context
from lightning_nanguard.exceptions import NonFiniteTrainingError
from lightning_nanguard.policies.skip import SkipBudget
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.reporting import emit, keys
from lightning_nanguard.signals.gradients import grad_reading, layer_norms

__all__ = ["GradNormMonitor"]


class GradNormMonitor(NanGuardCallback):
    """Log the gradient norm every logged step and drop any update whose loss or gradients are non-finite.

    The check runs in ``on_before_optimizer_step``, where the gradients are final: accumulated, all-reduced,
    unscaled, not yet clipped. It is one fused pass and one host read per step (shared with every other nanguard
    callback), and its verdict is reduced across ranks, so every rank skips or stops together.

    A skip is ``optimizer.zero_grad(set_to_none=True)``: parameters and optimizer state (Adam's step count and
    moments) stay exactly as they were. Under ``16-mixed`` the GradScaler already drops non-finite updates; the
    monitor then only counts them (``scaler_skip``). Skipped steps still advance ``global_step`` and the LR schedule,
    as GradScaler skips do in Lightning.

    Args:
        on_nonfinite: ``"skip"`` drops the update; ``"warn"`` lets it through and warns (the weights will be
            poisoned: for diagnosis only); ``"stop"`` drops it and stops training at once.
        max_consecutive_skips: bad steps in a row tolerated; one more stops training with
            ``NonFiniteTrainingError``. Counts GradScaler skips too.
        layer_depth: module depth at which per-layer gradient norms are grouped (``1``: top-level children,
            ``2``: their children, ...); ``None`` turns per-layer norms off.
        log_every_n_steps: how often per-layer norms (and the histogram) reach the loggers; ``None`` follows
            ``Trainer(log_every_n_steps)``.
        histogram: also write a TensorBoard histogram of the per-tensor gradient norms.
        spike_zscore: flag a step whose loss or gradient norm is this many standard deviations above its running
            mean (in log space, so a 10x jump is the same spike at any scale); ``None`` (default) turns spike
            detection off. The test runs on the device and shares the step's one host read.
        spike_warmup: finite steps observed before spikes are tested.
        on_spike: ``"warn"`` records and warns; ``"skip"`` drops the update (counted against
            ``max_consecutive_skips``); ``"rollback"`` drops it and asks ``AutoRollback`` to restore the last good state.

    Logged keys:
        ``nanguard/grad_norm``                   total 2-norm of the gradients (unscaled, pre-clip), logged steps
        ``nanguard/grad_norm_clipped``           the same after the Trainer's clipping, when it clips
        ``nanguard/nonfinite_grads``             number of gradient tensors holding a NaN/inf
        ``nanguard/skipped_steps``               cumulative updates dropped (by nanguard or the GradScaler)
        ``nanguard/layer_grad_norm/<module>``    per-layer norms, every ``log_every_n_steps`` in one batch
        ``nanguard/grad_norm_hist``              histogram of per-tensor norms (``histogram=True``)
        ``nanguard/incident/<action>``           1.0 at each step an incident happened

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        NonFiniteTrainingError: at the end of training, when the skip budget ran out or ``on_nonfinite="stop"``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[GradNormMonitor(on_nonfinite="skip", max_consecutive_skips=5)])
    """

    def __init__(
        self,
        on_nonfinite: Literal["warn", "skip", "stop"] = "skip",
        max_consecutive_skips: int = 20,
        layer_depth: int | None = 1,
        log_every_n_steps: int | None = None,
        histogram: bool = False,
        spike_zscore: float | None = None,
        spike_warmup: int = 50,
        on_spike: Literal["warn", "skip", "rollback"] = "warn",
    ) -> None:
        owner = type(self).__name__
        check_choice(owner, "on_nonfinite", on_nonfinite, ("warn", "skip", "stop"))
        check_int(owner, "max_consecutive_skips", max_consecutive_skips, minimum=0)
        check_int(owner, "layer_depth", layer_depth, minimum=1, allow_none=True)
        check_int(owner, "log_every_n_steps", log_every_n_steps, minimum=1, allow_none=True)
        check_choice(owner, "histogram", histogram, (True, False))
        check_float(owner, "spike_zscore", spike_zscore, low=0.0, low_inclusive=False, allow_none=True)
        check_int(owner, "spike_warmup", spike_warmup, minimum=1)
        check_choice(owner, "on_spike", on_spike, ("warn", "skip", "rollback"))
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.layer_depth = layer_depth
        self.log_every_n_steps = log_every_n_steps
        self.histogram = histogram
        self.spike_zscore, self.spike_warmup, self.on_spike = spike_zscore, spike_warmup, on_spike
        self._spikes = None if spike_zscore is None else SpikeWatch(float(spike_zscore), spike_warmup)
        self._budget = SkipBudget(on_nonfinite, max_consecutive_skips)
        self._restored_skips = 0

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(on_nonfinite=self.on_nonfinite, layer_depth=self.layer_depth)

    @property
    def skipped_steps(self) -> int:
        """Updates dropped so far (by nanguard or the GradScaler), across resumes."""
        trainer = getattr(self, "_trainer", None)
        return self._restored_skips + (get_context(trainer).skipped_steps if trainer is not None else 0)

    # ------------------------------------------------------------------ lifecycle
    @override
    def _setup_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: NanGuardContext) -> None:
        self._trainer = trainer
        if self.layer_depth is not None:
            ctx.set_layer_depth(type(self).__name__, self.layer_depth)
        if self._spikes is not None:
            self._spikes.attach(trainer)
            ctx.add_detector("spike", self._spikes.detect)
            if self.on_spike == "rollback" and not has_callback(trainer, "AutoRollback"):
                rank_zero_warn(
                    "GradNormMonitor(on_spike='rollback') asks AutoRollback to restore the last good state, but "
                    "AutoRollback is not installed: spiking updates will only be dropped. Add AutoRollback() to "
                    "Trainer(callbacks=...), or choose on_spike='skip' or 'warn'."
                )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        ctx = get_context(trainer)
        health = ctx.step_health(trainer, pl_module, optimizer)
        spike = not health.bad and health.flags.get("spike", False)
        if spike and self.on_spike != "warn":
            action = self._budget.decide(True, scaler_skips=False)
            self._act(trainer, pl_module, optimizer, health, Action.SKIP if action is Action.WARN else action, True)
        else:
            action = self._budget.decide(health.bad, scaler_skips=health.scaler_active)
            if action is not Action.NONE:
                self._act(trainer, pl_module, optimizer, health, action)
            elif spike:
                self._act(trainer, pl_module, optimizer, health, Action.WARN, True)
        if health.grads is None:
            return
        if _lightning_compat.should_update_logs(trainer):
            pl_module.log(keys.GRAD_NORM, health.grads.total_norm, on_step=True, on_epoch=False)
            pl_module.log(keys.NONFINITE_GRADS, health.grads.nonfinite.float(), on_step=True, on_epoch=False)
        if self._layers_due(trainer):
            index = ctx.param_index(pl_module, optimizer, health.optimizer_idx)
            names, values = layer_norms(index, health.grads)
            metrics = {f"{keys.LAYER_GRAD_NORM}/{n}": v for n, v in zip(names, values.tolist(), strict=True)}
            emit.log_event(trainer, metrics)
            if self.histogram:
                emit.log_histogram(trainer, keys.key("grad_norm_hist"), health.grads.tensor_norms)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not _lightning_compat.should_update_logs(trainer):
            return
        pl_module.log(keys.SKIPPED_STEPS, float(self.skipped_steps), on_step=True, on_epoch=False)
        clipped = self._clipped_norm(trainer, pl_module)
        if clipped is not None:
            # Straight to the loggers: through self.log, Lightning would re-emit the last value on a skipped step.
            emit.log_event(trainer, {keys.GRAD_NORM_CLIPPED: float(clipped.item())})

    @override
    def _teardown_fit(self, trainer: pl.Trainer) -> None:
        self._restored_skips = self.skipped_steps
        self._trainer = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "skipped_steps": self.skipped_steps,
            "streak": self._budget.streak,
            "total_bad": self._budget.total_bad,
            **({"spike": self._spikes.state()} if self._spikes is not None else {}),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_skips = int(state_dict.get("skipped_steps", 0))
        self._budget.streak = int(state_dict.get("streak", 0))
        self._budget.total_bad = int(state_dict.get("total_bad", 0))
        if self._spikes is not None and "spike" in state_dict:
            self._spikes.load(state_dict["spike"])

    # ------------------------------------------------------------------ internals
    def _act(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizer: Optimizer,
        health: Any,
        action: Action,
        spike: bool = False,
    ) -> None:
        ctx = get_context(trainer)
        name = type(self).__name__
        if action in (Action.SKIP, Action.SCALER_SKIP, Action.STOP):
            ctx.skip_step(trainer, optimizer, health, name)
        if spike and self._spikes is not None:
            trigger, zscores = self._spikes.describe()
            if action is Action.SKIP and self.on_spike == "rollback":
                ctx.request(trainer, "rollback", trigger=trigger, source=name)
            incident = make_incident(
                trainer,
                trigger=trigger,
                action=action,
                source=name,
                ranks=list(range(trainer.world_size)),  # the verdict is reduced; per-rank attribution is not kept
                values={**health.values(), **zscores},
                budget_left=self._budget.budget_left,
                message=self._spike_message(trainer, trigger, zscores, action),
            )
        else:
            incident = incident_from_health(
                trainer,
                health,
                action,
                name,
                budget_left=self._budget.budget_left,
                message=self._message(trainer, health, action),
            )
        ctx.record(trainer, incident)
        if action is Action.WARN:
            rank_zero_warn(incident.message)
        elif action is Action.STOP:
            ctx.request_stop(trainer, NonFiniteTrainingError(incident.message))

    def _spike_message(self, trainer: pl.Trainer, trigger: str, zscores: dict[str, float], action: Action) -> str:
        z = max(zscores["grad_norm_zscore"], zscores["loss_zscore"])
        what = (
            f"{trigger.replace('_', ' ')} at global_step={trainer.global_step} (epoch {trainer.current_epoch}): "
            f"{z:.1f} standard deviations above the running mean (spike_zscore={self.spike_zscore})"
        )
        if action is Action.STOP:
            return (
                f"Training stopped: {what}, {self._budget.streak} dropped steps in a row, more than "
                f"max_consecutive_skips={self.max_consecutive_skips}. Lower the learning rate, clip gradients, check "
                "the data at these steps, or add AutoRollback + OptimizerBackoff."
            )
        if action is Action.SKIP:
            then = "asked AutoRollback to restore the last good state" if self.on_spike == "rollback" else "dropped"
            return f"{what}; the update was {then} ({self._budget.budget_left} more in a row allowed)."
        return f"{what}; the update went through (on_spike='warn'). Use on_spike='skip' or 'rollback' to drop it."

    def _message(self, trainer: pl.Trainer, health: Any, action: Action) -> str:
        where = f"global_step={trainer.global_step} (epoch {trainer.current_epoch}, ranks {health.bad_ranks(trainer)})"
        what = health.trigger().replace("_", " ")
        if action is Action.STOP:
            if self.on_nonfinite == "stop":
                why = 'GradNormMonitor(on_nonfinite="stop") stops at the first one'
            else:
                why = (
                    f"{self._budget.streak} non-finite steps in a row, more than "
                    f"max_consecutive_skips={self.max_consecutive_skips}"
                )
            return (
                f"Training stopped: {what} at {where}; {why}. The update was dropped, so the weights are finite. "
                "Try a lower learning rate or gradient clipping, check the data at this step, run "
                "nanguard's FP32Evaluation/LossScaleWatchdog if in half precision, or raise max_consecutive_skips."
            )
        if action is Action.WARN:
            return (
                f"{what} at {where}; on_nonfinite='warn' lets this update through, so the weights are now "
                "likely non-finite. Use on_nonfinite='skip' to drop such updates."
            )
        if action is Action.SCALER_SKIP:
            return f"{what} at {where}; the GradScaler dropped the update and lowered its scale."
        return f"{what} at {where}; the update was dropped ({self._budget.budget_left} more in a row allowed)."

    def _layers_due(self, trainer: pl.Trainer) -> bool:
        if self.layer_depth is None and not self.histogram:
            return False
        if self.log_every_n_steps is None:
            return _lightning_compat.should_update_logs(trainer)
        return (_lightning_compat.log_step(trainer) + 1) % self.log_every_n_steps == 0

    def _clipped_norm(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Tensor | None:
        # After the step the clipped gradients are still on the parameters (zero_grad runs in the next closure).
        if not trainer.gradient_clip_val or not pl_module.automatic_optimization or not trainer.optimizers:
            return None
        ctx = get_context(trainer)
        out = ctx.last_outcome(trainer)
        if out is not None and out.skipped:
            return None
        reading = grad_reading(ctx.param_index(pl_module, trainer.optimizers[0], 0))
        return None if reading is None else reading.total_norm.to(torch.float32)
