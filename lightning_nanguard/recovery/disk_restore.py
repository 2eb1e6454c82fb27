"""Restore weights and optimizer state from a checkpoint file mid-fit, with public strategy calls, loops untouched.

``trainer._checkpoint_connector.restore(path)`` mid-fit rewinds the loops and ends the epoch early
(LIGHTNING_FACTS section 6), so this loads the pieces one by one: model, optimizers, GradScaler (only downward).
Param-group hyperparameters (lr, eps, betas...) in the file are *not* used: the live ones are put back after the
load, so an LR/eps backoff made since the checkpoint survives (the issue OPT hit: reloading the optimizer silently
reloaded old betas). Schedulers are not rewound, as for the in-memory path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

__all__ = ["DiskRestore", "restore_from_checkpoint"]


@dataclass(frozen=True)
class DiskRestore:
    path: str
    step: int  # the checkpoint's global_step
    log_step: int  # its logging step (``_batches_that_stepped``), for the TensorBoard purge
    scale: float | None  # the GradScaler scale saved in the file (applied only downward by the caller)


def restore_from_checkpoint(trainer: pl.Trainer, path: str) -> DiskRestore:
    """Load ``path``'s model and optimizer state into the running fit. Call on every rank."""
    strategy = trainer.strategy
    checkpoint: dict[str, Any] = strategy.load_checkpoint(path)
    hyper = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in trainer.optimizers]
    strategy.load_model_state_dict(checkpoint, strict=True)
    if checkpoint.get("optimizer_states"):
        strategy.load_optimizer_state_dict(checkpoint)
    for opt, groups in zip(trainer.optimizers, hyper, strict=True):
        for group, saved in zip(opt.param_groups, groups, strict=True):
            group.update(saved)
    scaler_state = checkpoint.get(type(trainer.precision_plugin).__qualname__) or {}
    scale = scaler_state.get("scale") if isinstance(scaler_state, dict) else None
    step = int(checkpoint.get("global_step", 0))
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    log_step = int(loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", step))
    return DiskRestore(path=path, step=step, log_step=log_step, scale=None if scale is None else float(scale))
