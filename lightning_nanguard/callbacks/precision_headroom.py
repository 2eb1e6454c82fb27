"""PrecisionHeadroom: how many bits each module has left before it overflows half precision, and a guard on the trend."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nanguard import _notices
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._common import check_strategy_supported
from lightning_nanguard.config import PrecisionHeadroomConfig, arguments_from
from lightning_nanguard.engine import Engine
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.parts.headroom import HeadroomWatch
from lightning_nanguard.policies.headroom import HeadroomSettings

__all__ = ["PrecisionHeadroom"]


@arguments_from(PrecisionHeadroomConfig)
class PrecisionHeadroom(NanGuardCallback):
    """Measure each module's headroom in the training precision every few steps, and move a module to float32
    before it overflows.

    Every ``every_n_steps`` optimizer steps (and at the first step of a fit), the output abs-max of every submodule
    is taken during the forward (forward hooks registered for that step only, one fused reduction on the device, one
    MAX all-reduce across ranks, a non-blocking copy read at the next step: no host synchronization on the step
    path). Headroom in bits is ``log2(dtype max / abs-max)``: float16's 65504 against an output of 2000 leaves 5
    bits. The same sample sees inside each forward: every half-precision op's abs-max against its dtype's max, and an
    ``exp``-like op's input against the dtype's log-max (``signals.op_headroom``: a dispatch mode over the forward,
    each op attributed to the innermost module running it; the module's ``"(ops)"`` entry, its worst op). A short
    history per module feeds a forecast: under ``16-mixed`` a module with fewer than ``margin_bits``
    left, or close to the limit and falling steadily enough to reach it within ``horizon_steps``, runs in float32 from
    then on (autocast off for its forward, as ``FP32Evaluation(promote_after=...)`` does after an overflow), before
    it overflows; the promotion is an incident with the history and the forecast. Samples come sooner while a module
    is close to the limit. When the loss is climbing too, the run is diverging and nothing is promoted (float32
    would only hide it). A module the forecast promoted runs in half precision again once its float32 output has
    kept 6 bits or more of would-be half-precision headroom for ``demote_after`` samples (its submodules' outputs
    too); one that comes back is promoted for good.

    Under ``bf16-*`` (float32's range) and ``16-true`` (no autocast to switch off) headroom is reported only. Under
    ``32-true`` the abs-maxima are still kept (in the checkpoint): a float32 run resumed in float16 has its modules
    judged against float16 before its first step. Every fit's first ``16-mixed`` step is tried before it runs: one
    traced ``training_step`` of its batch, leaving no trace (``recovery.first_step_trial``), its ops judged and its
    gradient measured at once (one host read, once per fit), so a module that cannot run in float16 is promoted
    and the GradScaler's scale starts where the gradient's headroom says, before the first update. A ``torch.compile``d
    module's samples see its module outputs only (its kernels are no aten ops); its first-step trial runs eagerly and
    sees every op. Under ``16-true``, which has no GradScaler, each module's parameter gradients are sampled too
    (``"<module> (gradient)"``, reported only).

    Under ``16-mixed`` the backward overflows too: autocast computes a weight's gradient in float16 at the loss scale,
    and the GradScaler only learns of an overflow after it (a dropped step, then it halves). A sampled step also
    reduces the largest parameter gradient times the scale that step ran with (on the device, into the same vector);
    where that loss-scaled gradient has less than ``scale_margin_bits`` of float16 headroom, the GradScaler's scale is
    lowered by a power of two before the next step, back to the margin (never raised: the GradScaler's growth does
    that; never below ``LossScaleWatchdog``'s ``min_scale``, 1.0 without it). A power of two changes no value that
    neither overflows nor underflows float16, so a healthy run's update is the same: it is counted and summed up at
    the end of fit, not an incident, and the watchdog does not count it as an overflow. The scale is cut at a batch
    start, so only under automatic optimization without gradient accumulation (under manual optimization the headroom
    is reported only; under gradient accumulation the gradient is not sampled).

    Its arguments are declared once, in ``lightning_nanguard.config.PrecisionHeadroomConfig`` (the "Args" below).

    Logged keys (every logging step, half precision only):
        ``nanguard/headroom_min``          the lowest headroom of any module at the last sample (bits)
        ``nanguard/headroom/<module>``     the headroom of the 8 modules with the least (bits)
        ``nanguard/promoted_modules``      modules the forecast runs in float32
        ``nanguard/incident/promote``      1.0 at a promotion (``nanguard/incident/demote`` at a demotion)
        ``nanguard/headroom_scaled_grad``  ``16-mixed``: the loss-scaled gradient's headroom at the last sample, at the
                                           scale that step ran with (bits)
        ``nanguard/loss_scale_lowered``    ``16-mixed``: times the scale was lowered ahead of an overflow (cumulative)

    Under DeepSpeed, FSDP1 and ``ModelParallelStrategy`` (FSDP2) it is untested and measures nothing (a note says
    so): single device and DDP are supported.

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(precision="16-mixed", callbacks=[PrecisionHeadroom(every_n_steps=25)])
    """

    owner = "PrecisionHeadroom"

    config: PrecisionHeadroomConfig

    def __init__(
        self,
        every_n_steps: int = 50,
        margin_bits: float = 1.0,
        horizon_steps: int = 200,
        demote_after: int | None = 20,
        promote: bool = True,
        scale_margin_bits: float | None = 4.0,
    ) -> None:
        self.config = c = PrecisionHeadroomConfig.from_arguments(type(self).__name__, locals())
        settings = HeadroomSettings(
            every_n_steps=c.every_n_steps,
            margin_bits=c.margin_bits,
            horizon_steps=c.horizon_steps,
            demote_after=c.demote_after,
            max_promotions=HeadroomSettings.max_promotions if c.promote else 0,
            scale_margin_bits=c.scale_margin_bits,
        )
        self.watch = HeadroomWatch(settings, c.owner)

    @property
    def promoted(self) -> list[str]:
        """The modules the forecast runs in float32, in promotion order."""
        return list(self.watch.promoted)

    @override
    def _check_environment(self, trainer: pl.Trainer) -> None:
        # Where it is untested it measures nothing, with a note, rather than refuse: the preset keeps running there.
        try:
            check_strategy_supported(trainer, type(self).__name__)
        except UnsupportedSetupError as error:
            self.watch.idle = str(error)
            _notices.note(f"PrecisionHeadroom measures nothing in this fit: {error}")
        else:
            self.watch.idle = ""

    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        engine.add_metrics(self.watch.metrics)
        engine.add_summary_notes(self.watch.summary_lines)
        engine.add_part(self)

    @override
    def _uninstall(self, trainer: pl.Trainer) -> None:
        self.watch.stop()

    # ------------------------------------------------------------------ its part (engine/parts.py)
    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watch.start(trainer, pl_module, self._engine_now)

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int) -> bool:
        """Read the last sample, arm the probe when one is due: True (the step is sampled) takes part in the rest."""
        return self.watch.tick(trainer, pl_module, self._engine_now, batch)

    def before_backward(self, trainer: pl.Trainer, loss: Tensor) -> None:
        self.watch.collect(trainer.global_step)

    def before_optimizer_step(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        self.watch.collect_grads(trainer, optimizer)

    def batch_end(self, trainer: pl.Trainer) -> None:
        self.watch.end_sample(trainer)

    def train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.watch.finish(trainer, pl_module, self._engine_now)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **self.watch.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.watch.load_state_dict(state_dict)
