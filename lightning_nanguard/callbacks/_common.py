"""Small pieces every nanguard callback adapter uses."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.reporting.incidents import Incident

__all__ = ["check_strategy_supported", "make_incident"]

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
    )
