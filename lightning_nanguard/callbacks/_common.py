"""Small pieces every nanguard callback adapter uses."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.reporting.incidents import Incident

__all__ = ["check_strategy_supported", "make_incident", "refusal_reason"]

# Why a strategy is refused, per strategy (its class name or a base's); ``"*"``: every callback.
_REFUSED: dict[str, dict[str, str]] = {
    "FSDPStrategy": {
        "*": (
            "FSDPStrategy (FSDP1) flattens parameters into FlatParameters and shards them outside DTensor, so neither "
            "the per-parameter reading nor the snapshots can see which piece a rank holds; nanguard's sharded support "
            "is built and tested for FSDP2 only, and FSDPStrategy cannot run on CPU to be tested here. Use "
            "strategy=ModelParallelStrategy() with torch.distributed.fsdp.fully_shard in configure_model (FSDP2), "
            "or strategy='ddp'"
        ),
    },
    "DeepSpeedStrategy": {
        "*": (
            "DeepSpeed's engine owns the step: ZeRO partitions and reduces the gradients in its own buckets, keeps "
            "its own loss scaler and decides its own overflow skips, so a reading or a skip in "
            "on_before_optimizer_step does not reach it. Use ModelParallelStrategy with fully_shard (FSDP2), or "
            "strategy='ddp'"
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
    combinations itself, ``fp32_evaluation.py``), tested on 2 CPU ranks;
    FSDPStrategy (FSDP1), DeepSpeedStrategy and XLAStrategy by none, each for the reason in its message.

    Raises:
        UnsupportedSetupError: ``owner`` does not support the Trainer's strategy.
    """
    hit = refusal_reason({cls.__name__ for cls in type(trainer.strategy).__mro__}, owner)
    if hit is not None:
        strategy, why = hit
        raise UnsupportedSetupError(f"{owner} does not support {strategy}: {why}, or remove the callback.")


def make_incident(
    trainer: pl.Trainer,
    *,
    trigger: str,
    action: Action | str,
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
        batch_idx = int(trainer.fit_loop.epoch_loop.batch_idx) if trainer.training else -1
    name = action.value if isinstance(action, Action) else str(action)
    return Incident(
        step=int(trainer.global_step) if step is None else step,
        epoch=int(trainer.current_epoch),
        batch_idx=batch_idx,
        ranks=list(ranks) if ranks is not None else [int(trainer.global_rank)],
        trigger=trigger,
        action=name,
        source=source,
        values=dict(values or {}),
        budget_left=budget_left,
        message=message,
        actions=[name],
        cause=cause,
        where=where,
    )
