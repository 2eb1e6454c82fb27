"""The arguments of the callbacks that recover a run: AutoRollback, OptimizerBackoff, LossScaleWatchdog."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from lightning_nanguard._validation import check_float
from lightning_nanguard.config._declare import CallbackConfig, Choice, Custom, Flag, Float, Int, PathArg, arg
from lightning_nanguard.exceptions import NanGuardConfigError, brief
from lightning_nanguard.policies.backoff import TRIGGERS, check_triggers, parse_triggers

__all__ = ["AutoRollbackConfig", "LossScaleWatchdogConfig", "OptimizerBackoffConfig"]


@dataclass(frozen=True)
class AutoRollbackConfig(CallbackConfig):
    """AutoRollback's arguments: when snapshots are taken and kept, and the budget of rollbacks."""

    kind: ClassVar[str] = "AutoRollback"

    every_n_steps: int = arg(
        50,
        Int(minimum=1),
        """Snapshot cadence in optimizer steps (its cost: the Performance page); a snapshot is also taken before the
        first step at a learning rate that jumped 2x or more over the step before's (a warm restart).""",
    )
    num_snapshots: int = arg(
        2,
        Int(minimum=0),
        'Snapshots kept in memory (each costs 12 bytes/param with AdamW); `0` with `source="disk"`.',
    )
    quiet_steps: int = arg(
        10, Int(minimum=0), "No snapshot within this many steps after an incident that distrusts the state."
    )
    max_rollbacks: int = arg(
        5,
        Int(minimum=1),
        """Rollbacks allowed within `rollback_window` steps; one more restores, saves a verified checkpoint and
        stops.""",
    )
    rollback_window: int = arg(1000, Int(minimum=1), "The budget window, in optimizer steps.")
    recurrence_steps: int = arg(50, Int(minimum=0), "A trigger this soon after a rollback restores an older snapshot.")
    skip_batches: int = arg(0, Int(minimum=0), "Batches after a rollback whose updates are dropped.")
    source: Literal["memory", "disk"] = arg(
        "memory",
        Choice(("memory", "disk")),
        """`"memory"` (snapshots; without a usable one, the newest verified checkpoint file of a step at or before the
        current one, weights-only) or `"disk"` (verified checkpoints only).""",
    )
    checkpoint_dir: str | None = arg(
        None,
        PathArg(),
        """Where verified checkpoints are found and the final one is written when no ModelCheckpoint is configured
        (with `source="disk"`: an existing directory).""",
    )
    max_snapshot_bytes: int | None = arg(
        None,
        Int(minimum=1, allow_none=True),
        """Host memory per rank for all slots (`None`: no limit; under DDP a rank keeps 1/world of each): fewer
        slots, with a warning, when not all fit; an error at train start if none does.""",
    )

    def _check_together(self, owner: str) -> None:
        directory = self.checkpoint_dir
        if self.source == "disk" and directory is not None and not os.path.isdir(directory):
            raise NanGuardConfigError(
                f"{owner}(source='disk', checkpoint_dir={os.fspath(directory)!r}): must be an existing directory "
                "(the verified checkpoints a rollback restores from). Leave checkpoint_dir unset to use "
                "ModelCheckpoint's dirpath."
            )


def _check_triggers(owner: str, name: str, value: object) -> None:
    check_triggers(owner, value)


@dataclass(frozen=True)
class OptimizerBackoffConfig(CallbackConfig):
    """OptimizerBackoff's arguments: what lowers the learning rate (and eps), by how much, and how it recovers."""

    kind: ClassVar[str] = "OptimizerBackoff"

    lr_factor: float = arg(
        0.5,
        Float(low=0.0, high=1.0, low_inclusive=False, high_inclusive=False),
        "Multiply the learning-rate scale by this at each backoff.",
    )
    min_lr_scale: float = arg(
        0.01,
        Float(low=0.0, high=1.0, low_inclusive=False),
        "Floor of the scale (relative to the configured schedule).",
    )
    triggers: str = arg(
        "rollback,skip,loss_scale_collapse",
        Custom(_check_triggers, "comma-separated names among " + ", ".join(f"`{t}`" for t in TRIGGERS)),
        """Event kinds that may lower the learning rate: `rollback` (a rollback for divergence), `skip` (repeated
        drops a lower rate answers), `loss_scale_collapse`.""",
    )
    skips_before_backoff: int = arg(
        3, Int(minimum=1), "Such dropped updates needed within `skip_window` steps for one backoff."
    )
    skip_window: int = arg(100, Int(minimum=1), "The window, in optimizer steps, those skips are counted over.")
    recover_after: int | None = arg(
        None,
        Int(minimum=1, allow_none=True),
        """Healthy optimizer steps (no incident) before the scale is raised one notch; `None`: never. A level a notch
        reached that is backed off again within `recover_after` steps is never climbed to again.""",
    )
    recover_steps: int = arg(
        1,
        Int(minimum=1),
        """Notches from one backoff back to the previous level (each multiplies the scale by
        `(1 / lr_factor) ** (1 / recover_steps)`, capped at 1.0).""",
    )
    recover_with_schedule: bool = arg(
        False,
        Flag(),
        """A backoff caps the rate, held through the schedule: one notch below the rate the step that diverged ran
        with, and not above the rate the state a rollback restored had trained at (where it had trained long enough
        at a steady rate to show it; else not above the rate the kept snapshots were taken at unless that is a
        further notch below). Where the schedule rises (the rest of a warmup, a restart) the rate stays at the cap; as
        the schedule falls below it (a decay, the end of a warm restart) the scale climbs back towards 1.0, as far as
        keeps the rate at the cap.""",
    )
    eps_backoff: Literal["auto", "always", "never"] = arg(
        "auto",
        Choice(("auto", "always", "never")),
        '`"auto"` (fp16 non-fused groups), `"always"` (every group with an eps) or `"never"`.',
    )
    eps_factor: float = arg(
        10.0, Float(low=1.0, high=1e6, low_inclusive=False), "Multiply eps by this at each eps backoff."
    )
    max_eps: float = arg(1e-2, Float(low=0.0, high=1.0, low_inclusive=False), "Eps is never raised above this.")
    on_hazard: Literal["fix", "warn", "raise", "off"] = arg(
        "fix",
        Choice(("fix", "warn", "raise", "off")),
        """Preflight before step 1: `"fix"` (raise an underflowing eps to `safe_eps`), `"warn"`, `"raise"`
        (`UnsupportedSetupError`), `"off"`.""",
    )
    safe_eps: float = arg(
        1e-4,
        Float(low=0.0, high=1.0, low_inclusive=False),
        'The eps a `"fix"` sets (at least the dtype\'s smallest normal number).',
    )

    @property
    def trigger_set(self) -> frozenset[str]:
        """``triggers``, parsed."""
        return parse_triggers(self.triggers)


def _check_min_scale(owner: str, name: str, value: Any) -> None:
    check_float(owner, name, value, low=0.0, low_inclusive=False, high=3.0e38)
    if float(torch.tensor(float(value), dtype=torch.float32)) <= 0.0:
        raise NanGuardConfigError(
            f"{owner}({name}={brief(value)}): is 0.0 in float32 (the GradScaler's dtype), so no floor would "
            "hold: must be at least 1.4e-45."
        )


@dataclass(frozen=True)
class LossScaleWatchdogConfig(CallbackConfig):
    """LossScaleWatchdog's arguments: the scale's floor and cap, what makes a collapse, and what a collapse does."""

    kind: ClassVar[str] = "LossScaleWatchdog"

    min_scale: float = arg(
        1.0,
        Custom(_check_min_scale, "finite number in (0, 3e+38], not 0 in float32", float),
        "The floor, so the scale never reaches `0.0`. Megatron and DeepSpeed default to 1.",
    )
    max_scale: float | None = arg(
        None,
        Float(low=0.0, low_inclusive=False, high=3.0e38, allow_none=True),
        "An optional cap (`None`: the GradScaler's growth is unbounded).",
    )
    floor_patience: int | None = arg(
        10,
        Int(minimum=1, allow_none=True),
        "Overflowing steps at the floor that make a collapse (`None`: not this rule).",
    )
    max_overflow_streak: int | None = arg(
        30,
        Int(minimum=1, allow_none=True),
        "Consecutive overflowing steps that make a collapse (`None`: not this rule).",
    )
    on_collapse: Literal["auto", "warn", "rollback", "stop"] = arg(
        "auto",
        Choice(("auto", "warn", "rollback", "stop")),
        '`"auto"` (roll back when AutoRollback is installed, else stop), `"rollback"`, `"warn"` or `"stop"`.',
    )
    max_collapses: int | None = arg(
        3,
        Int(minimum=0, allow_none=True),
        "Collapses met before one more stops training with `RecoveryBudgetExhausted` (`None`: unbounded).",
    )
    window: int = arg(100, Int(minimum=1), "Steps over which `nanguard/overflow_rate` is computed.")
