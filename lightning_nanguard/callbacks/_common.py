"""Small pieces every nanguard callback adapter uses."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.reporting.incidents import Incident

__all__ = ["check_strategy_supported", "has_callback", "incident_from_health", "make_incident"]

_UNSUPPORTED = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy")


def check_strategy_supported(trainer: pl.Trainer, owner: str) -> None:
    """Refuse sharded strategies: their gradients and optimizer state are sharded and their scalers are their own."""
    names = {cls.__name__ for cls in type(trainer.strategy).__mro__}
    hit = sorted(names.intersection(_UNSUPPORTED))
    if hit:
        raise UnsupportedSetupError(
            f"{owner} does not support {hit[0]} yet: its gradients and optimizer state are sharded, so a local "
            "reading would be wrong. Use strategy='ddp' (or single device), or remove the callback."
        )


def has_callback(trainer: pl.Trainer, name: str) -> bool:
    """Whether a callback of class ``name`` is installed (by name: callbacks may cooperate without importing)."""
    return any(type(cb).__name__ == name for cb in getattr(trainer, "callbacks", []))


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
) -> Incident:
    """An Incident stamped with the Trainer's current position."""
    if batch_idx is None:
        batch_idx = int(trainer.fit_loop.epoch_loop.batch_idx) if trainer.training else -1
    return Incident(
        step=int(trainer.global_step),
        epoch=int(trainer.current_epoch),
        batch_idx=batch_idx,
        ranks=list(ranks) if ranks is not None else [int(trainer.global_rank)],
        trigger=trigger,
        action=action.value if isinstance(action, Action) else str(action),
        source=source,
        values=dict(values or {}),
        budget_left=budget_left,
        message=message,
    )


def incident_from_health(
    trainer: pl.Trainer, health: Any, action: Action, source: str, *, budget_left: int, message: str
) -> Incident:
    """An Incident for a bad StepHealth (host reads and one all-gather: incident path only, on every rank)."""
    return make_incident(
        trainer,
        trigger=health.trigger(),
        action=action,
        source=source,
        ranks=health.bad_ranks(trainer),
        values=health.values(),
        budget_left=budget_left,
        message=message,
    )
