"""GradNormMonitor: the gradient norm on the dashboard, a non-finite update stopped before it lands, its cause found."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard import _notices
from lightning_nanguard.callbacks import _deepspeed
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._state import warn_unloaded_quarantine
from lightning_nanguard.config import GradNormMonitorConfig, arguments_from
from lightning_nanguard.config.grad_norm_monitor import MAX_REPLAY_STEPS
from lightning_nanguard.engine import Engine, get_engine
from lightning_nanguard.exceptions import CheckpointVerificationError
from lightning_nanguard.parts.grad_metrics import grad_metrics, layers_due
from lightning_nanguard.policies.withdrawal import Blames
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.signals.loss_climb import load_spikes_state, spikes_state

__all__ = ["GradNormMonitor"]


@arguments_from(GradNormMonitorConfig)
class GradNormMonitor(NanGuardCallback):
    """Log the gradient norm, drop any update whose loss or gradients are non-finite, find out why, and keep the
    data that caused it away.

    The check runs in ``on_before_optimizer_step`` on the final gradients (accumulated, all-reduced, unscaled, not
    clipped): one fused pass and one host read per step (none where the optimizer can act on a device flag), shared
    with every other nanguard callback and reduced across ranks, so every rank skips or stops together.

    A skip is ``optimizer.zero_grad(set_to_none=True)``: parameters and optimizer state stay exactly as they were.
    Under ``16-mixed`` the GradScaler drops non-finite updates itself (``scaler_skip``). Skipped steps still advance
    ``global_step`` and the LR schedule, as GradScaler skips do in Lightning.

    On each incident the cause is diagnosed (``forensics``): the batch (non-finite or out-of-range inputs and
    targets), the state (named non-finite parameters, buffers, optimizer tensors), the recent history, and, when that
    does not settle it, a replay of the batch with hooks on every module and in float32. When the data is to blame
    (``input_data``, ``targets``), it is quarantined (``quarantine=True``): the dataset samples are replaced when they
    come back (or the batch's update is dropped, for datasets without sample indices), with no new incident.

    Its arguments are declared once, in ``lightning_nanguard.config.GradNormMonitorConfig`` (the "Args" below).

    Logged keys (every logging step, one batched logger call):
        ``nanguard/grad_norm``                   total 2-norm of the gradients (unscaled, pre-clip), last step
        ``nanguard/grad_norm_max``               the largest total norm since the last logging step (inf if any
                                                 step was non-finite), so a bad step is never hidden by the sampling
        ``nanguard/nonfinite_steps``             non-finite steps since the last logging step
        ``nanguard/grad_norm_clipped``           the total norm after the Trainer's clipping, when it clips
        ``nanguard/loss``                        the step's loss as the optimizer saw it (unscaled), last step
        ``nanguard/skipped_steps``               cumulative updates dropped (by nanguard or the GradScaler)
        ``nanguard/quarantined``                 samples (and batches) quarantined so far
        ``nanguard/layer_grad_norm/<module>``    per-layer norms, every ``log_every_n_steps``
        ``nanguard/grad_norm_hist``              histogram of per-tensor norms (``histogram=True``)
        ``nanguard/incident/<action>``           1.0 at each step an incident took that action

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        NonFiniteTrainingError: at the end of training, when nothing could recover (see the message).

    Example: ``Trainer(callbacks=[GradNormMonitor(on_nonfinite="skip", max_consecutive_skips=5)])``.
    """

    config: GradNormMonitorConfig

    def __init__(
        self,
        on_nonfinite: Literal["warn", "skip", "stop"] = "skip",
        max_consecutive_skips: int = 20,
        layer_depth: int | None = 1,
        log_every_n_steps: int | None = None,
        histogram: bool = False,
        spike_zscore: float | None = None,
        spike_warmup: int = 50,
        on_spike: Literal["warn", "skip", "rollback", "probe"] = "warn",
        quarantine: bool = True,
        quarantine_file: str | None = None,
        forensics: Literal["first", "every", "off"] = "first",
        max_replay_steps: float = MAX_REPLAY_STEPS,
        max_dropped_fraction: float | None = 0.05,
        dropped_window: int = 1000,
        on_dropped_budget: Literal["stop", "warn"] = "stop",
        bundle_mb: float = 64.0,
        max_quarantined_fraction: float = 0.005,
    ) -> None:
        self.config = GradNormMonitorConfig.from_arguments(type(self).__name__, locals())
        self._quarantine = Quarantine(self.config.quarantine_file) if quarantine else None
        self._restored_skips = 0
        self._spike_state: dict[str, Any] = {}
        self._blames_state: dict[str, Any] = {}  # the chains of data hypotheses, between fits (``policies.withdrawal``)
        self._pending_blames: dict[str, Any] | None = None  # loaded before a fit's setup: applied there
        self._engine: Engine | None = None

    @property
    def skipped_steps(self) -> int:
        """Updates dropped in this fit (or the last one) by nanguard or the GradScaler, across resumes."""
        return self._restored_skips + (self._engine.skipped_steps if self._engine is not None else 0)

    @property
    def quarantined_samples(self) -> list[int]:
        """Dataset sample indices quarantined in this fit (or the last one), across resumes."""
        return sorted(self._quarantine.samples) if self._quarantine is not None else []

    # ------------------------------------------------------------------ lifecycle
    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Its part's (engine/parts.py): what the installed callbacks leave this guard unable to do, said once."""
        if (
            self.config.on_spike == "rollback"
            and self.config.spike_zscore is not None
            and get_engine(trainer).restorer is None
        ):
            _notices.warn(
                f"{type(self).__name__}(on_spike='rollback') hands a spike to AutoRollback, which is not installed: "
                "a spike is only skipped. Add AutoRollback(), or use on_spike='skip'."
            )
        if (
            self.config.on_spike == "probe"
            and self.config.spike_zscore is not None
            and get_engine(trainer).restorer is None
        ):
            _notices.note(
                f"{type(self).__name__}(on_spike='probe'): the probe batch is AutoRollback's, which is not installed: "
                "spikes are only counted."
            )

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        # A new fit starts from nothing (a callback reused for another Trainer); a resume's ``load_state_dict``
        # comes after ``setup`` and restores the counts and the spike statistics.
        self._engine, self._restored_skips, self._spike_state = engine, 0, {}
        pending, self._pending_blames, self._blames_state = self._pending_blames, None, {}
        if pending is not None and self._quarantine is not None:  # loaded before this fit's setup
            engine.incidents.blames.load_state_dict(pending)
        engine.add_part(self)
        if _deepspeed.is_deepspeed(trainer):  # DeepSpeed's engine owns the step: its outcome is read after it
            probing = self.config.on_spike == "probe" and self.config.spike_zscore is not None
            if probing:  # the preset's setting: spikes go unprobed there rather than the preset being refused
                _notices.note(
                    f"{type(self).__name__}(on_spike='probe'): spikes are not tested under DeepSpeedStrategy (its "
                    "engine applies the update before the grad norm exists, and AutoRollback keeps no probe there)."
                )
            _deepspeed.install_grad_watch(
                trainer,
                engine,
                spike_zscore=None if probing else self.config.spike_zscore,
                max_consecutive_skips=self.config.max_consecutive_skips,
                skipped_before=self._restored_skips,
            )
            return
        if self._quarantine is not None:
            self._quarantine.install()
        engine.set_guard(self.config, self._quarantine)
        if self.config.layer_depth is not None:
            engine.sensor.layer_depth = max(engine.sensor.layer_depth, self.config.layer_depth)
        engine.add_metrics(self._metrics)

    @override
    def _uninstall(self, trainer: pl.Trainer) -> None:
        self._restored_skips = self.skipped_steps
        engine = self._engine
        if engine is not None and engine.spikes is not None:
            self._spike_state = spikes_state(engine.spikes)
        if engine is not None and self._quarantine is not None:
            self._blames_state = engine.incidents.blames.state_dict()
        self._engine = None

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        engine = self._engine
        spikes = engine.spikes if engine is not None else None
        spike_state = spikes_state(spikes) if spikes else self._spike_state
        return {
            "version": 2,
            "skipped_steps": self.skipped_steps,
            **({"spike": spike_state} if spike_state else {}),
            **({"quarantine": self._quarantine.state_dict()} if self._quarantine is not None else {}),
            **({"blames": self._blames()} if self._quarantine is not None else {}),
        }

    def _blames(self) -> dict[str, Any]:
        """The chains of data hypotheses that justify the quarantine: this fit's, else the last one's."""
        if self._engine is not None:
            return self._engine.incidents.blames.state_dict()
        return dict(self._blames_state) or Blames().state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_skips = int(state_dict.get("skipped_steps", 0))
        self._spike_state = dict(state_dict.get("spike", {}))
        spikes = self._engine.spikes if self._engine is not None else None
        if spikes is not None and self._spike_state:  # a resume: after ``setup``, into this fit's statistics
            load_spikes_state(spikes, self._spike_state)
        saved = state_dict.get("quarantine")
        if self._quarantine is not None and saved is not None:
            self._quarantine.load_state_dict(saved)
        else:
            warn_unloaded_quarantine(type(self).__name__, saved)
        blames = state_dict.get("blames")
        if self._quarantine is not None and blames is not None:
            self._load_blames(blames)

    def _load_blames(self, saved: object) -> None:
        engine = self._engine
        try:
            if engine is not None:  # a resume: after ``setup``, into this fit's record
                engine.incidents.blames.load_state_dict(saved)
            else:
                Blames().load_state_dict(saved)  # validated now, applied at the next fit's setup
                self._pending_blames = self._blames_state = dict(saved) if isinstance(saved, dict) else {}
        except ValueError as err:
            raise CheckpointVerificationError(
                f"{type(self).__name__}: the checkpoint's blames (the data hypotheses behind its quarantine) are "
                f"malformed ({err}); resume from another checkpoint, or with {type(self).__name__}(quarantine=False)."
            ) from None

    # ------------------------------------------------------------------ metrics (one batched logger call)
    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        engine = self._engine
        if engine is None:
            return {}
        return grad_metrics(
            trainer,
            engine.ledger.interval,
            engine.last_reading,
            skipped=self.skipped_steps,
            quarantine=self._quarantine,
            layers=layers_due(trainer, self.config.layer_depth, self.config.log_every_n_steps, self.config.histogram),
            histogram=self.config.histogram,
        )
