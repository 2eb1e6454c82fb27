"""What each callback brings to the engine: its configuration (``lightning_nanguard.config``) and remedy executors,
registered at setup.

The engine runs the five stages; callbacks hold configuration and carry out their own remedy when the policy plans
it. A capability that is not registered is not planned (ablation = which capabilities are registered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import lightning.pytorch as pl

from lightning_nanguard.config import GradNormMonitorConfig
from lightning_nanguard.contract import Divergence
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.policies.loss_scale import CollapseFacts
from lightning_nanguard.policies.probe import ProbeVerdict
from lightning_nanguard.policies.snapshot_rates import RestoredRates
from lightning_nanguard.recovery.backoff_scales import BackoffResult
from lightning_nanguard.signals.loss_climb import LossTrend

__all__ = [
    "DEFAULT_DROPPED_WINDOW",
    "DEFAULT_MAX_CONSECUTIVE_SKIPS",
    "DEFAULT_MAX_DROPPED_FRACTION",
    "Backoff",
    "MetricSource",
    "Promoter",
    "Restored",
    "Restorer",
    "ScaleWatch",
]


# With no GradNormMonitor installed, the engine guards with its defaults (where AutoRollback is installed).
DEFAULT_MAX_CONSECUTIVE_SKIPS = GradNormMonitorConfig.max_consecutive_skips
DEFAULT_MAX_DROPPED_FRACTION = GradNormMonitorConfig.max_dropped_fraction
DEFAULT_DROPPED_WINDOW = GradNormMonitorConfig.dropped_window
DEFAULT_MAX_QUARANTINED_FRACTION = GradNormMonitorConfig.max_quarantined_fraction


@dataclass(frozen=True)
class Restored:
    """What a rollback restored."""

    step: int  # global_step of the restored state
    source: str  # "memory" | "disk"
    path: str = ""  # the checkpoint, for "disk"
    recurrence: bool = False
    in_window: int = 1
    repaired: tuple[str, ...] = ()  # only these buffers were restored (``Restorer.repair_buffers``)


class Restorer(Protocol):
    """AutoRollback."""

    owner: str
    divergence: Divergence | None  # what the last ``diverging()`` that answered True saw

    @property
    def probe_verdict(self) -> ProbeVerdict | None:
        """What the last ``probe_spike()`` found."""
        ...

    def can_restore(self, trainer: pl.Trainer, step: int) -> bool: ...

    def rates_at(self, step: int) -> RestoredRates:
        """The rates the kept snapshots up to ``step`` were taken and trained at."""
        ...

    def budget_left(self, step: int) -> int: ...

    def before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, batch: object) -> bool:
        """Snapshot when due; False when the state was found non-finite (the engine then handles that event).
        ``batch``: this batch, where it may give the probe its samples (``None``: its data is quarantined)."""
        ...

    def probe_spike(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        batch_loss: float | None,
        trend: LossTrend | None = None,
    ) -> ProbeVerdict | None:
        """At a spike of ``step`` (whose batch lost ``batch_loss``; ``trend``: what the training loss says, a climb
        probed alone included): the probe batch re-scored with the current weights, against the newest sound
        snapshot's weights and the probe's recent past (every rank calls it: one all-reduce). ``None`` when nothing
        was probed."""
        ...

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Restored | None: ...

    def repair_buffers(self, trainer: pl.Trainer, pl_module: pl.LightningModule, names: list[str]) -> Restored | None:
        """Restore only the named buffers (a batch's forward wrote them non-finite; the parameters and optimizer
        state are sound): no rollback, no budget. ``None`` when no snapshot holds them (then ``restore``)."""
        ...

    def skip_batch(self) -> bool:
        """True while batches after a rollback are to be skipped (counts one)."""
        ...

    def diverging(self) -> bool:
        """True once when a snapshot was judged taken mid-divergence: the run is diverging now (the engine then
        handles that event). Judged from the engine's reduced readings, so identical on every rank."""
        ...

    def save_final(self, trainer: pl.Trainer, step: int) -> str:
        """Save a verified checkpoint before a stop; its path (``""`` when none was written)."""
        ...

    def sound_reference(self, names: set[str]) -> tuple[int, dict[str, float]] | None:
        """The newest snapshot judged sound (its step) and the largest |value| of each of ``names`` it holds on this
        rank (incident path only: finite damage is judged against it); ``None`` when there is none in memory."""
        ...


class Backoff(Protocol):
    """OptimizerBackoff."""

    owner: str
    triggers: frozenset[str]
    skips_before_backoff: int
    skip_window: int

    def eps_applies(self, trainer: pl.Trainer) -> bool: ...

    def back_off(self, trainer: pl.Trainer, *, lr: bool, eps: bool, cause: str) -> BackoffResult:
        """Apply now (after the scheduler step)."""
        ...


class ScaleWatch(Protocol):
    """LossScaleWatchdog."""

    owner: str

    @property
    def on_collapse(self) -> str: ...

    @property
    def min_scale(self) -> float:
        """The floor the scale is held to: nothing lowers it below."""
        ...

    def observe(self, trainer: pl.Trainer, reading: Reading) -> CollapseFacts | None: ...

    def after_step(self, trainer: pl.Trainer, readings: Sequence[Reading] = ()) -> None: ...

    def collapses_left(self) -> int | None: ...


class Promoter(Protocol):
    """FP32Evaluation(promote_after=...): a training module that keeps overflowing runs in float32."""

    owner: str
    promote_after: int | None
    promoted: list[str]  # modules already running in float32

    def promote(self, trainer: pl.Trainer, pl_module: pl.LightningModule, module: str) -> str: ...


class MetricSource(Protocol):
    """Contributes host floats to the one batched logger call of each logging step."""

    def __call__(self, trainer: pl.Trainer) -> dict[str, float]: ...
