"""FP32Evaluation: validation and test that do not overflow in half precision."""

from __future__ import annotations

import functools
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard._validation import check_choice, check_int
from lightning_nanguard.callbacks._base import mute_idle_hooks, unmute_hooks
from lightning_nanguard.callbacks._common import check_strategy_supported, make_incident
from lightning_nanguard.contract import Action, Cause
from lightning_nanguard.engine import get_engine
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.recovery.eval_precision import (
    AttributePatches,
    DeferredLog,
    Fp32Weights,
    autocast_disabled,
    default_dtype,
    nonfinite_flag,
)
from lightning_nanguard.recovery.promote import promote
from lightning_nanguard.reporting import keys

__all__ = ["FP32Evaluation"]

_STAGES = {"validation_step": ("validation", "val_step_context"), "test_step": ("test", "test_step_context")}


class FP32Evaluation(Callback):
    """Run validation and test in float32 (always, or only for the batches that come out non-finite in half precision).

    Lightning evaluates under the training precision. A model that forces float32 only where training needs it
    (VMamba's selective scan, a softmax, a ``log`` of a small difference) then evaluates that part in float16/bfloat16,
    and a validation loss of NaN poisons ``EarlyStopping`` and ``ModelCheckpoint`` while training is fine.

    How, per precision (training is never touched; every patch is put back at the end of each evaluation, restoring
    what was there before, so ``torch.compile``-d steps stay compiled):

    * ``16-mixed``/``bf16-mixed``: autocast is disabled for the step (the precision plugin's ``val_step_context``/
      ``test_step_context`` is patched between ``on_{validation,test}_start`` and ``*_end``). Weights are float32.
    * ``16-true``/``bf16-true``: the step runs on temporary float32 copies of the weights
      (``torch.func.functional_call``) with float32 inputs; the real parameters are never cast, which keeps DDP's
      gradient all-reduce intact. The copies cost one float32 copy of the model in memory during evaluation (built
      lazily, once per evaluation).
    * ``32-true``/``64-true``: nothing to do; a warning says so once.

    ``mode="on_nonfinite"`` evaluates in the training precision and re-runs in float32 only the batches whose returned
    outputs or ``self.log``-ged values are non-finite; the float32 results replace the half-precision ones (what the
    step logged in the bad call is dropped, the re-run's values are logged instead), and each re-run is an incident
    (``"validation batch 3 overflowed in float16; finite in float32"``). A healthy evaluation costs one host read per
    batch and no float32 work. Under DDP each rank decides its re-runs alone (no collective per batch, so ranks with
    different numbers of batches cannot deadlock; what a step logs is deferred and logged once per batch on every
    rank, so ``sync_dist=True`` stays in step); the re-runs are gathered and recorded at the epoch end. A step that
    runs collectives of its own (``self.all_gather``) must use ``mode="always"``. Under ``16-true``/
    ``bf16-true`` the batch reaches ``on_{validation,test}_batch_start`` in float32 (it is cast to the half dtype just
    for the first attempt). Limits: ``torchmetrics`` objects updated inside the step see both calls of a re-run batch
    (use ``mode="always"`` for such modules); a ``dataloader_iter`` step cannot be re-run (warned, left as is).

    Under ``ModelParallelStrategy`` (FSDP2) ``mode="always"`` runs under ``bf16-mixed`` (autocast off in every
    evaluation step of every rank: the steps, and so FSDP2's all-gathers, stay the same on every rank). A
    ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))`` all-gathers the parameters in
    bfloat16 whatever autocast says: FP32Evaluation cannot see that policy, and evaluation then stays in bfloat16.
    ``mode="on_nonfinite"``, ``16-true``/``bf16-true`` and ``promote_after`` are refused there (see Raises).

    With ``promote_after=N`` it also remedies training: once forensics has named the same training module as the
    site of a half-precision overflow ``N`` times (under ``*-mixed``), that module runs in float32 from then on
    (autocast off for its forward, its inputs cast to float32; ``recovery/promote.py``). The promotion is an incident,
    is kept in the callback state and re-applied when training resumes from a checkpoint. Under ``*-true`` the
    parameters are half precision and there is no autocast to switch off: nothing is promoted, and the overflows are
    skipped and reported (train under ``*-mixed`` to use this remedy).

    Args:
        mode: ``"always"`` runs every validation and test step in float32; ``"on_nonfinite"`` re-runs only the
            non-finite batches in float32.
        promote_after: half-precision overflows attributed to one training module before it runs in float32;
            ``None`` (default): never.

    Logged keys:
        ``nanguard/eval/fp32_reruns``      batches re-run in float32 in this evaluation epoch (``"on_nonfinite"``)
        ``nanguard/incident/rerun``        1.0 at each re-run incident (``"on_nonfinite"``)

    ``mode="always"`` logs nothing and leaves the user's metric names as they are.

    Raises:
        NanGuardConfigError: at construction, for a ``mode`` outside its choices.
        UnsupportedSetupError: at setup, under FSDPStrategy/DeepSpeedStrategy/XLAStrategy; under ModelParallelStrategy
            (FSDP2) for ``mode="on_nonfinite"`` (a re-run on one rank would hang the FSDP2 all-gathers) and for
            ``16-true``/``bf16-true`` (float32 copies of sharded parameters) and ``promote_after`` under ``*-mixed``
            (untested); ``mode="always"`` under ``bf16-mixed`` runs there (and anything under ``32-true``, a no-op).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(precision="bf16-mixed", callbacks=[FP32Evaluation(mode="on_nonfinite")])
    """

    owner = "FP32Evaluation"

    def __init__(self, mode: Literal["always", "on_nonfinite"] = "always", promote_after: int | None = None) -> None:
        check_choice(type(self).__name__, "mode", mode, ("always", "on_nonfinite"))
        check_int(type(self).__name__, "promote_after", promote_after, minimum=1, allow_none=True)
        self.mode = mode
        self.promote_after = promote_after
        self.promoted: list[str] = []  # training modules running in float32, in promotion order
        self.fp32_reruns = 0  # batches re-run in float32, over the callback's lifetime (and across resumes)
        self._kind: Literal["mixed", "true", "none"] = "none"
        self._half: torch.dtype = torch.float16
        self._stage = ""
        self._warned = False
        self._patches = AttributePatches()
        self._weights: Fp32Weights | None = None
        self._pending: list[tuple[str, int, bool]] = []  # this rank's re-runs of the evaluation epoch

    @property
    @override
    def state_key(self) -> str:
        # Lightning reads it for every hook of every callback: build it once.
        key = self.__dict__.get("_state_key_cache")
        if key is None:
            key = self.__dict__["_state_key_cache"] = self._generate_state_key(mode=self.mode)
        return key

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unmute_hooks(self)
        check_strategy_supported(trainer, type(self).__name__)
        self._stage = stage
        self._kind, self._half = _precision_kind(trainer.precision_plugin)
        if "ModelParallelStrategy" in _lightning_compat.strategy_class_names(trainer):
            why = _sharded_refusal(self.mode, self._kind, self.promote_after)
            if why:
                raise UnsupportedSetupError(
                    f"FP32Evaluation(mode={self.mode!r}) does not support ModelParallelStrategy under "
                    f"precision={trainer.precision!r}: {why}"
                )
        if self._kind == "none":
            message = (
                f"FP32Evaluation has nothing to do: the Trainer evaluates in {trainer.precision!r}, not half precision "
                "(16-mixed, bf16-mixed, 16-true or bf16-true). Evaluation runs unchanged"
            )
            if self.mode == "always":  # asked for float32 evaluation explicitly: say it is moot, as a warning
                self._warn_once(message + "; remove the callback or train in half precision.")
            elif not self._warned:  # "on_nonfinite" (the preset's) is a natural no-op in full precision
                self._warned = True
                rank_zero_info(message + ".")
        engine = get_engine(trainer)
        engine.join(trainer, self, fit=False)
        if stage == "fit" and self.promote_after is not None:
            engine.set_promoter(self)
        mute_idle_hooks(self, drives=False)  # no per-batch work: Lightning need not dispatch those hooks to it

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Promotions restored from a checkpoint (load_state_dict ran before this hook) are re-applied.
        if self._kind == "mixed":
            for path in self.promoted:
                _promote(pl_module.get_submodule(path), trainer)

    def promote(self, trainer: pl.Trainer, pl_module: pl.LightningModule, module: str) -> str:
        """The engine's Promoter: run ``module`` (a path in the LightningModule) in float32 from now on."""
        try:
            target = pl_module.get_submodule(module)
        except AttributeError:
            return f"could not move {module} to float32: no such module"
        if self._kind != "mixed":
            return f"{module} was not moved to float32: under {trainer.precision!r} there is no autocast to switch off"
        if _promote(target, trainer) and module not in self.promoted:
            self.promoted.append(module)
        return f"moved {module} to float32 from now on (autocast off for its forward)"

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._begin(trainer, pl_module, "validation_step")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()
        if self._stage == "validate":
            get_engine(trainer).finish(trainer, raise_pending=False)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._begin(trainer, pl_module, "test_step")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_end(trainer, pl_module)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end()
        get_engine(trainer).finish(trainer, raise_pending=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        get_engine(trainer).train_end(trainer, pl_module)  # the end-of-fit check runs once, whoever calls first

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end()
        get_engine(trainer).finish(trainer, raise_pending=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unmute_hooks(self)
        self._end()
        get_engine(trainer).close()

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": 2, "fp32_reruns": self.fp32_reruns, "promoted": list(self.promoted)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fp32_reruns = int(state_dict.get("fp32_reruns", 0))
        self.promoted = [str(p) for p in state_dict.get("promoted", [])]

    # ------------------------------------------------------------------ patching
    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step_name: str) -> None:
        self._end()  # a previous evaluation that ended abnormally
        self._pending = []
        if self._kind == "none":
            return
        plugin = trainer.precision_plugin
        context_name = _STAGES[step_name][1]
        step = getattr(pl_module, step_name)
        if self.mode == "on_nonfinite" and is_param_in_hook_signature(step, "dataloader_iter", explicit=True):
            self._warn_once(
                f"FP32Evaluation(mode='on_nonfinite') cannot re-run a `{step_name}(dataloader_iter)`: the batch is "
                "consumed by the step. Evaluation runs unchanged; use mode='always' instead."
            )
            return
        convert = plugin.convert_input  # the half-precision cast, for the first attempt under "on_nonfinite"
        if self._kind == "true":
            self._weights = Fp32Weights(pl_module)
            # The batch stays float32; the half-precision attempt ("on_nonfinite") casts it itself.
            self._patches.set(plugin, "convert_input", _identity)
        if self.mode == "always":
            if self._kind == "mixed":
                device = str(getattr(plugin, "device", "cpu"))
                self._patches.set(plugin, context_name, lambda: autocast_disabled(device))
                return  # the step itself is untouched: weights and inputs are already float32
            self._patches.set(plugin, context_name, lambda: default_dtype(torch.float32))
        deferred = DeferredLog(pl_module.log) if self.mode == "on_nonfinite" else None
        if deferred is not None:
            self._patches.set(pl_module, "log", deferred)
        self._patches.set(pl_module, step_name, self._wrap(trainer, plugin, step, step_name, deferred, convert))

    def _end(self) -> None:
        self._patches.restore()
        if self._weights is not None:
            self._weights.release()
            self._weights = None

    def _wrap(
        self,
        trainer: pl.Trainer,
        plugin: Any,
        step: Any,
        step_name: str,
        deferred: DeferredLog | None,
        convert: Any,
    ) -> Any:
        @functools.wraps(step)
        def fp32_step(*args: Any, **kwargs: Any) -> Any:
            if deferred is None:  # mode="always", true half precision
                return self._fp32_call(plugin, step, args, kwargs)
            first_args = (convert(args[0]), *args[1:]) if self._kind == "true" and args else args
            deferred.begin()
            try:
                output = step(*first_args, **kwargs)
            except BaseException:
                deferred.discard()
                raise
            # This rank decides alone (one host read, no collective): ranks may see different numbers of batches,
            # and a per-batch collective would then wait forever. The logged values are deferred, so each rank
            # still logs once per batch; the re-runs are gathered and recorded at the epoch end.
            if not bool(nonfinite_flag(output, deferred.values())):
                deferred.replay()
                return output
            deferred.discard()  # the bad call's logged values must not reach Lightning's epoch accumulation
            output = self._fp32_call(plugin, step, args, kwargs)
            batch_idx = int(args[1]) if len(args) > 1 and isinstance(args[1], int) else int(kwargs.get("batch_idx", -1))
            self._pending.append((_STAGES[step_name][0], batch_idx, not bool(nonfinite_flag(output))))
            return output

        return fp32_step

    def _fp32_call(self, plugin: Any, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._kind == "mixed":
            with autocast_disabled(str(getattr(plugin, "device", "cpu"))):
                return step(*args, **kwargs)
        assert self._weights is not None
        with default_dtype(torch.float32):
            return self._weights.call(step, *args, **kwargs)

    # ------------------------------------------------------------------ reporting
    def _epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.mode != "on_nonfinite" or self._kind == "none":
            return
        # Every rank reaches the epoch end, whatever its number of batches: the one collective of the evaluation.
        pending, self._pending = self._pending, []
        gathered = _distributed.all_gather_objects(trainer, pending)
        reruns: dict[tuple[str, int], list[tuple[int, bool]]] = {}
        for rank, part in enumerate(gathered):
            for stage, batch_idx, fp32_finite in part:  # type: ignore[attr-defined]
                reruns.setdefault((stage, batch_idx), []).append((rank, fp32_finite))
        for (stage, batch_idx), where in sorted(reruns.items()):
            self._record_rerun(trainer, stage, batch_idx, [r for r, _ in where], all(ok for _, ok in where))
        self.fp32_reruns += len(reruns)
        if trainer.sanity_checking:
            return
        # Identical on every rank (gathered); sync_dist with "max" keeps Lightning's DDP advice quiet.
        pl_module.log(keys.EVAL_FP32_RERUNS, float(len(reruns)), reduce_fx="max", sync_dist=True)
        if reruns:
            stage = "test" if trainer.testing else "validation"
            rank_zero_info(
                f"FP32Evaluation re-ran {len(reruns)} {stage} batch(es) in float32 because they were non-finite "
                f"in {str(self._half).replace('torch.', '')}; see the nanguard incidents. mode='always' avoids the "
                "double work if this happens often."
            )

    def _record_rerun(
        self, trainer: pl.Trainer, stage: str, batch_idx: int, ranks: list[int], fp32_finite: bool
    ) -> None:
        half = str(self._half).replace("torch.", "")
        if not fp32_finite:
            message = (
                f"{stage} batch {batch_idx} is non-finite in {half} and in float32 too: not a precision overflow. "
                "Check this batch's data and the model's weights."
            )
        else:
            message = f"{stage} batch {batch_idx} overflowed in {half}; finite in float32"
        incident = make_incident(
            trainer,
            trigger="nonfinite_eval_output",
            action=Action.RERUN,
            source=type(self).__name__,
            ranks=ranks,
            values={"stage": stage, "eval_batch_idx": batch_idx, "fp32_finite": fp32_finite},
            message=message,
            batch_idx=batch_idx,
            step=_lightning_compat.log_step(trainer),  # the step the evaluation's metrics are plotted at
            cause=(Cause.HALF_PRECISION_OVERFLOW if fp32_finite else Cause.UNKNOWN).value,
            where=f"{stage} batch {batch_idx}",
        )
        get_engine(trainer).sink.record(trainer, incident)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            rank_zero_warn(message)


def _sharded_refusal(mode: str, kind: str, promote_after: int | None) -> str:
    """Why FP32Evaluation cannot run this way under ModelParallelStrategy (FSDP2), or ``""`` when it can.

    ``mode="always"`` under ``*-mixed`` only switches autocast off in the evaluation step: every rank runs the same
    steps as without it, so FSDP2's all-gathers stay paired across ranks (tested on 2 CPU ranks).
    """
    if mode == "on_nonfinite" and kind != "none":
        return (
            "mode='on_nonfinite' re-runs a batch in float32 on the rank that saw it non-finite, and an FSDP2 forward "
            "all-gathers the parameters, so a re-run on one rank alone would wait forever for the others (a hang). "
            "Use FP32Evaluation(mode='always'), which runs every evaluation step in float32 on every rank"
        )
    if promote_after is not None and kind == "mixed":  # elsewhere nothing is ever promoted
        return (
            "promote_after (moving a training module to float32 after repeated overflows) is not tested under FSDP2. "
            "Use promote_after=None"
        )
    if kind == "true":
        return (
            "under 16-true/bf16-true the float32 evaluation runs on temporary float32 copies of the parameters "
            "(torch.func.functional_call), which would bypass FSDP2's all-gather of the sharded (DTensor) "
            "parameters. Train in precision='bf16-mixed' to evaluate in float32 with mode='always', or remove the "
            "callback"
        )
    return ""


def _promote(module: torch.nn.Module, trainer: pl.Trainer) -> bool:
    return promote(module, str(getattr(trainer.precision_plugin, "device", "cpu")))


def _identity(data: Any) -> Any:
    return data


def _precision_kind(plugin: Any) -> tuple[Literal["mixed", "true", "none"], torch.dtype]:
    """How the Trainer evaluates: under autocast ("mixed"), on half weights ("true"), or already in full precision."""
    if isinstance(plugin, MixedPrecision):
        return "mixed", torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
    if isinstance(plugin, HalfPrecision):
        return "true", torch.bfloat16 if plugin.precision == "bf16-true" else torch.float16
    return "none", torch.float32
