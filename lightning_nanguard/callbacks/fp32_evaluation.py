"""FP32Evaluation: validation and test that do not overflow in half precision."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard import _distributed, _lightning_compat, _notices
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._common import (
    check_strategy_supported,
    fp32_evaluation_sharded_refusal,
    rerun_incident,
)
from lightning_nanguard.config import FP32EvaluationConfig, arguments_from
from lightning_nanguard.engine import Engine, get_engine
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.precision import FULL_PRECISION, classify_precision
from lightning_nanguard.recovery.eval_precision import (
    Fp32Eval,
    autocast_device,
    group_reruns,
)
from lightning_nanguard.recovery.promote import promote, promote_submodule
from lightning_nanguard.reporting import keys

__all__ = ["FP32Evaluation"]


@arguments_from(FP32EvaluationConfig)
class FP32Evaluation(NanGuardCallback):
    """Run validation and test in float32 (always, or only for the batches that come out non-finite in half precision).

    Lightning evaluates under the training precision. A model that forces float32 only where training needs it
    (VMamba's selective scan, a softmax, a ``log`` of a small difference) then evaluates that part in float16/bfloat16,
    and a validation loss of NaN poisons ``EarlyStopping`` and ``ModelCheckpoint`` while training is fine.

    How, per precision (training is never touched; every patch is put back at the end of each evaluation, so
    ``torch.compile``-d steps stay compiled; ``recovery/eval_precision.py`` has the mechanics):

    * ``16-mixed``/``bf16-mixed``: autocast is disabled for the step. Weights are float32.
    * ``16-true``/``bf16-true``: the step runs on temporary float32 copies of the weights with float32 inputs (the
      batch reaches ``on_*_batch_start`` in float32); the real parameters are never cast (DDP's all-reduce stays
      intact). The copies cost one float32 copy of the model in memory during evaluation.
    * ``32-true``/``64-true``: nothing to do; a warning says so once.

    ``mode="on_nonfinite"`` evaluates in the training precision and re-runs in float32 only the batches whose returned
    outputs or ``self.log``-ged values are non-finite; the float32 results replace the half-precision ones (logged
    values, and the states of the module's ``torchmetrics`` metrics: put back before the re-run, so a metric counts
    the batch once), and each evaluation epoch with re-runs is one incident with their count and batch indices
    (``"2 validation batches (1, 3) overflowed in float16 and were re-run in float32, ..."``). A healthy evaluation
    costs one host read per batch (plus one copy of each metric state, where the module has metrics). Under DDP each
    rank decides its re-runs alone (no collective per batch, so ranks with different numbers of batches cannot
    deadlock); they are gathered and recorded at the epoch end. Limits: a step that runs collectives of its own
    (``self.all_gather``) needs ``mode="always"``; metrics held outside the module tree (a plain ``list``) are not
    put back; a ``dataloader_iter`` step cannot be re-run (warned).

    Under ``ModelParallelStrategy`` (FSDP2) ``mode="always"`` runs under ``bf16-mixed`` (every rank runs the same
    steps, so FSDP2's all-gathers stay paired). A ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=
    torch.bfloat16))`` all-gathers the parameters in bfloat16 whatever autocast says: evaluation then stays in
    bfloat16. The other combinations are refused there (see Raises).

    With ``promote_after=N`` it also remedies training: once forensics has named the same training module as the
    site of a half-precision overflow ``N`` times (under ``*-mixed``), that module runs in float32 from then on
    (``recovery/promote.py``). The promotion is an incident, kept in the callback state and re-applied at a resume.
    Under ``*-true`` there is no autocast to switch off: nothing is promoted (train under ``*-mixed`` for this remedy).

    Its arguments are declared once, in ``lightning_nanguard.config.FP32EvaluationConfig`` (the "Args" below).

    Logged keys (``mode="always"`` logs nothing):
        ``nanguard/eval/fp32_reruns``      batches re-run in float32 in this evaluation epoch (``"on_nonfinite"``)
        ``nanguard/incident/rerun``        1.0 at each re-run incident, one per epoch with re-runs (``"on_nonfinite"``)

    Raises:
        NanGuardConfigError: at construction, for a ``mode`` outside its choices.
        UnsupportedSetupError: at setup, under FSDPStrategy/DeepSpeedStrategy/XLAStrategy; under ModelParallelStrategy
            (FSDP2) for ``mode="on_nonfinite"`` (a re-run on one rank would hang the all-gathers), ``16-true``/
            ``bf16-true`` and ``promote_after`` under ``*-mixed`` (untested).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(precision="bf16-mixed", callbacks=[FP32Evaluation(mode="on_nonfinite")])
    """

    owner = "FP32Evaluation"

    config: FP32EvaluationConfig
    steps_member = False  # evaluation is not a training step: it never drives the engine
    every_stage = True  # validate and test run its evaluation too

    def __init__(self, mode: Literal["always", "on_nonfinite"] = "always", promote_after: int | None = None) -> None:
        self.config = FP32EvaluationConfig.from_arguments(type(self).__name__, locals())
        self.promoted: list[str] = []  # training modules running in float32, in promotion order
        self.fp32_reruns = 0  # batches re-run in float32, over the callback's lifetime (and across resumes)
        self._precision = FULL_PRECISION
        self._warned = False
        self._eval = Fp32Eval(self.config.mode)

    # ------------------------------------------------------------------ lifecycle
    @override
    def _check_environment(self, trainer: pl.Trainer) -> None:
        check_strategy_supported(trainer, type(self).__name__)
        self._precision = classify_precision(trainer)
        self._eval.kind = kind = self._precision.kind
        why = fp32_evaluation_sharded_refusal(self.config.mode, kind, self.config.promote_after)
        if why and "ModelParallelStrategy" in _lightning_compat.strategy_class_names(trainer):
            raise UnsupportedSetupError(
                f"FP32Evaluation(mode={self.config.mode!r}) does not support ModelParallelStrategy under "
                f"precision={trainer.precision!r}: {why}"
            )
        if kind == "none":
            message = (
                f"FP32Evaluation has nothing to do: the Trainer evaluates in {trainer.precision!r}, not half precision "
                "(16-mixed, bf16-mixed, 16-true or bf16-true). Evaluation runs unchanged"
            )
            if self.config.mode == "always":  # asked for float32 evaluation explicitly: say it is moot, as a warning
                self._warn_once(message + "; remove the callback or train in half precision.")
            elif not self._warned:  # "on_nonfinite" (the preset's) is a natural no-op in full precision
                self._warned = True
                _notices.note(message + ".")

    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        if self._stage == "fit" and self.config.promote_after is not None:
            engine.set_promoter(self)
        engine.add_part(self)

    @override
    def _uninstall(self, trainer: pl.Trainer) -> None:
        self._eval.end()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._eval.end()
        get_engine(trainer).finish(trainer, raise_pending=False)

    def promote(self, trainer: pl.Trainer, pl_module: pl.LightningModule, module: str) -> str:
        """The engine's Promoter: run ``module`` (a path in the LightningModule) in float32 from now on."""
        device, mixed = autocast_device(trainer.precision_plugin), self._precision.mixed
        done, message = promote_submodule(pl_module, module, device, mixed=mixed, precision=str(trainer.precision))
        if done and module not in self.promoted:
            self.promoted.append(module)
        return message

    # ------------------------------------------------------------------ its part (engine/parts.py)
    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Promotions restored from a checkpoint (load_state_dict ran before this hook) are re-applied.
        if self._precision.mixed:
            for path in self.promoted:
                promote(pl_module.get_submodule(path), autocast_device(trainer.precision_plugin))

    def evaluation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step_name: str) -> None:
        self._eval.begin(trainer.precision_plugin, pl_module, step_name, self._warn_once)

    def evaluation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.mode != "on_nonfinite" or self._eval.kind == "none":
            return
        # Every rank reaches the epoch end, whatever its number of batches: the one collective of the evaluation.
        pending, self._eval.pending = self._eval.pending, []
        groups = group_reruns(_distributed.all_gather_objects(trainer, pending))
        half = self._precision.dtype_name
        incidents = get_engine(trainer).incidents
        for group in groups:  # one incident per outcome and epoch, with the count and the batches
            incidents.report(trainer, rerun_incident(trainer, group, half, type(self).__name__))
        count = sum(len(group.batches) for group in groups)
        self.fp32_reruns += count
        if trainer.sanity_checking:
            return
        # Identical on every rank (gathered); sync_dist with "max" keeps Lightning's DDP advice quiet.
        pl_module.log(keys.EVAL_FP32_RERUNS, float(count), reduce_fx="max", sync_dist=True)

    def evaluation_end(self, trainer: pl.Trainer) -> None:
        self._eval.end()

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": 2, "fp32_reruns": self.fp32_reruns, "promoted": list(self.promoted)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fp32_reruns = int(state_dict.get("fp32_reruns", 0))
        self.promoted = [str(p) for p in state_dict.get("promoted", [])]

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            _notices.warn(message)
