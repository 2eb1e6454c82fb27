"""AutoRollback's small helpers: the pending trigger record, the parameter check, and its messages."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl

from lightning_nanguard import _distributed
from lightning_nanguard.policies.rollback import RollbackDecision, RollbackPolicy
from lightning_nanguard.recovery.snapshot import model_tensors
from lightning_nanguard.signals.tensors import all_finite

__all__ = ["Pending", "exhausted_message", "params_nonfinite", "pending_from_request", "rollback_message"]


@dataclasses.dataclass(frozen=True)
class Pending:
    """A rollback trigger decided in on_before_optimizer_step, acted on in on_train_batch_end."""

    trigger: str
    ranks: list[int]
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def pending_from_request(request: dict[str, Any], trainer: pl.Trainer) -> Pending:
    """A trigger from ``ctx.request(trainer, "rollback", trigger=..., source=...)``."""
    by = {"requested_by": str(request.get("source", ""))}
    return Pending(str(request.get("trigger", "requested")), list(range(trainer.world_size)), by)


def params_nonfinite(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Any rank's parameters or buffers hold a NaN/inf: one fused pass, one host read, one reduction."""
    tensors = [t for t in model_tensors(pl_module) if t.is_floating_point()]
    return _distributed.any_rank(trainer, ~all_finite(tensors))


def rollback_message(
    what_where: str, from_step: int, source: str, decision: RollbackDecision, policy: RollbackPolicy
) -> str:
    return (
        f"{what_where}: update dropped, state restored from step {from_step} ({source}); rollback "
        f"{decision.in_window} of {policy.max_rollbacks} allowed within {policy.window} steps."
    )


def exhausted_message(
    what_where: str, from_step: int, path: str, decision: RollbackDecision, policy: RollbackPolicy
) -> str:
    return (
        f"AutoRollback gave up: {what_where}, was rollback {decision.in_window} within {policy.window} steps, more "
        f"than max_rollbacks={policy.max_rollbacks} ({policy.total} in total this run). The state from step "
        f"{from_step} was restored and saved to {path} (verified finite). Training keeps diverging from good "
        "states: lower the learning rate (OptimizerBackoff), raise Adam eps under 16-true, clip gradients, skip "
        "more batches after a rollback (skip_batches), check the data near this step, or raise "
        "max_rollbacks/rollback_window."
    )
