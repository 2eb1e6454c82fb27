"""Small pieces every nanguard callback adapter uses."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_nanguard import _lightning_compat
from lightning_nanguard.contract import Action, Cause, Notice
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.recovery.eval_precision import RerunGroup, rerun_message, rerun_where
from lightning_nanguard.reporting.incidents import Incident
from lightning_nanguard.signals import fsdp1

__all__ = [
    "check_strategy_supported",
    "fp32_evaluation_sharded_refusal",
    "make_incident",
    "refusal_reason",
    "rerun_incident",
]

# Why a strategy is refused, per strategy (its class name or a base's); ``"*"``: every callback.
_REFUSED: dict[str, dict[str, str]] = {
    # FSDP1: decided per Trainer (use_orig_params, precision, callback) by signals/fsdp1.refusal.
    "FSDPStrategy": {},
    # DeepSpeed: LossScaleWatchdog and GradNormMonitor read DeepSpeed's own step after it (callbacks/_deepspeed.py).
    "DeepSpeedStrategy": {
        "AutoRollback": (
            "DeepSpeed keeps the fp32 master weights and the optimizer state inside its own (ZeRO-partitioned) "
            "optimizer, not in the module or an optimizer state Lightning hands over, so a snapshot of them would "
            "not restore training: the master copy overwrites restored parameters at the next step, and restoring "
            "it needs DeepSpeed's own checkpoint (engine.load_checkpoint), which AutoRollback does not drive. Use "
            "DeepSpeed's checkpoints to resume, or strategy='ddp' / ModelParallelStrategy (FSDP2)"
        ),
        "OptimizerBackoff": (
            "it lowers the learning rate as part of the engine's remedy for an incident (with a rollback), and "
            "under DeepSpeed no such remedy runs (no rollback; LossScaleWatchdog and GradNormMonitor stop or warn), "
            "while DeepSpeed steps its own optimizer and LR scheduler inside engine.step(). Lower the learning rate "
            "in DeepSpeed's config or the LightningModule instead"
        ),
        "FP32Evaluation": (
            "DeepSpeed converts the module to fp16/bf16 itself and keeps the fp32 master weights partitioned inside "
            "its optimizer, so neither a float32 re-run nor a float32 evaluation copy can be built from the module "
            "Lightning holds. Evaluate from a DeepSpeed checkpoint converted to fp32 "
            "(zero_to_fp32.py) instead"
        ),
        "PrecisionHeadroom": (
            "DeepSpeed casts the module to fp16/bf16 itself, so there is no autocast to switch off for one module, "
            "and the sampled forward hooks are untested under it"
        ),
        "CheckpointGuard": (
            "DeepSpeed writes its own checkpoint directory (mp_rank_*_model_states.pt and one "
            "zero_pp_rank_*_optim_states.pt per rank, through engine.save_checkpoint), whose layout CheckpointGuard's "
            "verification and manifest do not read; it is untested there"
        ),
    },
    # FSDP2: every other callback is tested there (tests/sharded).
    "ModelParallelStrategy": {
        "PrecisionHeadroom": (
            "its sampled forward hooks and the float32 promotion are untested on fully_shard modules (a "
            "MixedPrecisionPolicy casts the parameters whatever autocast says)"
        ),
    },
    "XLAStrategy": {
        "*": (
            "XLA tensors are lazy: the per-step host read would cut and compile the step's graph, and the fused "
            "foreach kernels and collectives nanguard uses are untested on XLA. Train on GPU/CPU"
        ),
    },
}


def refusal_reason(strategy_names: set[str], owner: str) -> tuple[str, str] | None:
    """``(strategy, why)`` if ``owner`` refuses one of ``strategy_names`` (a strategy's MRO class names)."""
    for strategy in sorted(strategy_names.intersection(_REFUSED)):
        reasons = _REFUSED[strategy]
        why = reasons.get(owner, reasons.get("*"))
        if why is not None:
            return strategy, why
    return None


def check_strategy_supported(trainer: pl.Trainer, owner: str) -> None:
    """Refuse a strategy ``owner`` does not support (docs/SHARDED.md has the table).

    Single device and DDP are supported by every callback; ModelParallelStrategy (FSDP2 ``fully_shard``, DTensor
    parameters) by GradNormMonitor, AutoRollback, OptimizerBackoff, LossScaleWatchdog, CheckpointGuard (directory
    and single-file checkpoints) and FP32Evaluation (``mode="always"`` under ``bf16-mixed``; it refuses its other
    combinations itself, ``fp32_evaluation.py``), tested on 2 CPU ranks (PrecisionHeadroom is refused there: it then
    measures nothing, rather than stop the fit);
    FSDPStrategy (FSDP1) under ``use_orig_params=True`` (Lightning's default) and ``32-true``/``bf16-mixed`` by
    GradNormMonitor, AutoRollback, OptimizerBackoff, LossScaleWatchdog and CheckpointGuard (``state_dict_type=
    "sharded"``), tested on 2 CPU ranks (``signals/fsdp1.py``:
    ``refusal`` says why the rest are refused; ``install`` marks the parameters' shares once the model is wrapped);
    DeepSpeedStrategy by LossScaleWatchdog and GradNormMonitor (DeepSpeed's own loss scaler, overflow flag and
    global grad norm, read after its step: ``callbacks/_deepspeed.py``), the rest refused for the reason in
    ``_REFUSED``; XLAStrategy by none, for the reason in its message.

    Raises:
        UnsupportedSetupError: ``owner`` does not support the Trainer's strategy.
    """
    hit = refusal_reason(_lightning_compat.strategy_class_names(trainer), owner)
    if hit is not None:
        strategy, why = hit
        raise UnsupportedSetupError(f"{owner} does not support {strategy}: {why}, or remove the callback.")
    if fsdp1.is_fsdp1(trainer.strategy):
        fsdp1_why = fsdp1.refusal(trainer, owner)
        if fsdp1_why is not None:
            raise UnsupportedSetupError(f"{owner} does not support FSDPStrategy: {fsdp1_why}, or remove the callback.")
        fsdp1.install(trainer.strategy)


def make_incident(
    trainer: pl.Trainer,
    *,
    trigger: Notice,
    action: Action,
    source: str,
    ranks: list[int] | None = None,
    values: dict[str, Any] | None = None,
    budget_left: int = -1,
    message: str = "",
    batch_idx: int | None = None,
    step: int | None = None,
    cause: str = "",
    where: str = "",
) -> Incident:
    """An Incident for an event outside a training step (a checkpoint, a preflight finding, an evaluation re-run)."""
    if batch_idx is None:
        batch_idx = _lightning_compat.train_batch_idx(trainer)
    action = action if isinstance(action, Action) else Action(action)
    return Incident(
        step=int(trainer.global_step) if step is None else step,
        epoch=int(trainer.current_epoch),
        batch_idx=batch_idx,
        ranks=list(ranks) if ranks is not None else [int(trainer.global_rank)],
        trigger=trigger,
        action=action,
        source=source,
        values=dict(values or {}),
        budget_left=budget_left,
        message=message,
        actions=[action],
        cause=Cause(cause) if cause else None,
        where=where,
    )


def rerun_incident(trainer: pl.Trainer, group: RerunGroup, half: str, source: str) -> Incident:
    """FP32Evaluation's incident for one evaluation epoch's re-run batches of one outcome (``half``: the dtype)."""
    return make_incident(
        trainer,
        trigger=Notice.NONFINITE_EVAL_OUTPUT,
        action=Action.RERUN,
        source=source,
        ranks=list(group.ranks),
        values={
            "stage": group.stage,
            "count": len(group.batches),
            "eval_batches": list(group.batches),
            "fp32_finite": group.fp32_finite,
        },
        message=rerun_message(group, half),
        batch_idx=-1,
        step=_lightning_compat.log_step(trainer),  # the step the evaluation's metrics are plotted at
        cause=(Cause.HALF_PRECISION_OVERFLOW if group.fp32_finite else Cause.UNKNOWN).value,
        where=rerun_where(group),
    )


def fp32_evaluation_sharded_refusal(mode: str, kind: str, promote_after: int | None) -> str:
    """Why FP32Evaluation cannot run this way under ModelParallelStrategy (FSDP2), or ``""`` when it can.

    ``kind`` is ``Precision.kind``. ``mode="always"`` under ``*-mixed`` only switches autocast off in the evaluation
    step: every rank runs the same steps as without it, so FSDP2's all-gathers stay paired across ranks (tested on 2
    CPU ranks).
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
