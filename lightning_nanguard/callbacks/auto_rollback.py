"""AutoRollback: keep verified-good training states, and restore one when the state is damaged or training diverges."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.config import AutoRollbackConfig, arguments_from
from lightning_nanguard.contract import Divergence
from lightning_nanguard.engine import Engine
from lightning_nanguard.parts.rollback import Rollback
from lightning_nanguard.policies.rollback import RollbackPolicy
from lightning_nanguard.policies.snapshot_health import SnapshotBook
from lightning_nanguard.policies.snapshot_rates import SnapshotRates
from lightning_nanguard.recovery.probe import SnapshotProbe
from lightning_nanguard.recovery.snapshot import SnapshotRing

__all__ = ["AutoRollback"]


@arguments_from(AutoRollbackConfig)
class AutoRollback(NanGuardCallback):
    """Keep verified-finite snapshots of the training state in memory; restore one when the state is damaged or
    training diverges.

    **Snapshots** are taken in ``on_train_batch_start`` (the state before that step's update; every rank on the same
    steps) every ``every_n_steps`` optimizer steps and before the first step at a learning rate that jumped (2x or
    more over the step before, after 10 steps of training: the state that trained at the old rate, which a divergence
    at the new one goes back to), into ``num_snapshots`` preallocated CPU buffers, only when the parameters and
    buffers pass one fused finiteness check (reduced across ranks; a failed check is an incident) and
    no incident that distrusts the state happened in the last ``quiet_steps`` steps.

    **A rollback** restores the newest good snapshot in ``on_train_batch_end`` when the engine's remedy policy plans
    it (the README's table: a damaged state, a divergence, a loss-scale collapse, too many dropped updates in a row;
    not a bad sample whose update was dropped with the state intact): an older one on a trigger within
    ``recurrence_steps`` of the previous rollback, newer ones discarded, then ``skip_batches`` batches without an
    update. Buffers a batch's forward wrote non-finite, all else sound, are restored alone (no rollback, no budget).
    Parameters, buffers and the optimizer state roll back in place; param-group hyperparameters, schedulers,
    ``global_step``, the RNG and Lightning's loops do not; the GradScaler keeps the lower scale. A snapshot whose own
    step's gradient norm and loss are both >10x the last sound snapshot's is a suspect (a restore passes over it); the
    trend after it decides (``policies/snapshot_health.py``): growth that does not turn is a divergence, an event
    (``diverging``); a jump that falls back or holds (a new data domain) is not. At the end of fit, non-finite weights
    left by the last update are restored too.

    Its arguments are declared once, in ``lightning_nanguard.config.AutoRollbackConfig`` (the "Args" below).

    Logged keys:
        ``nanguard/rollbacks``                 cumulative rollbacks, every logged step
        ``nanguard/rollback_skipped_batches``  cumulative batches skipped after rollbacks, every logged step
        ``nanguard/incident/rollback``         1.0 at each rollback (the incident names ``restored_from_step``)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at train start, with ``source="disk"`` and no checkpoint directory.
        RecoveryBudgetExhausted: at the end of training, when the rollback budget ran out.
        NonFiniteTrainingError: at the end of training, when the state was damaged and nothing could restore it.

    Example::

        >>> trainer = Trainer(callbacks=[AutoRollback(every_n_steps=50, max_rollbacks=5, skip_batches=100)])
    """

    owner = "AutoRollback"

    config: AutoRollbackConfig

    def __init__(
        self,
        every_n_steps: int = 50,
        num_snapshots: int = 2,
        quiet_steps: int = 10,
        max_rollbacks: int = 5,
        rollback_window: int = 1000,
        recurrence_steps: int = 50,
        skip_batches: int = 0,
        source: Literal["memory", "disk"] = "memory",
        checkpoint_dir: str | None = None,
        max_snapshot_bytes: int | None = None,
    ) -> None:
        self.config = AutoRollbackConfig.from_arguments(type(self).__name__, locals())
        self.part = Rollback(self.config, type(self).__name__)  # what it does (parts/rollback.py)

    @property
    def rollbacks(self) -> int:
        """Rollbacks in this fit (or the last one), across resumes."""
        return self.part.policy.total

    @property
    def skipped_batches(self) -> int:  # batches whose updates were dropped after rollbacks, across resumes
        return self.part.policy.skipped_batches

    @property
    def ring(self) -> SnapshotRing:
        """The snapshots in memory."""
        return self.part.ring

    @property
    def book(self) -> SnapshotBook:
        """The judgement of the snapshots (sound, suspect, the trend after a suspect)."""
        return self.part.book

    @property
    def probe(self) -> SnapshotProbe:
        """The probe batch, scored at each snapshot and spike where spikes are probed."""
        return self.part.probe

    @property
    def rates(self) -> SnapshotRates:
        """The learning rates each kept snapshot was taken and trained at."""
        return self.part.rates

    @property
    def policy(self) -> RollbackPolicy:
        """The rollback budget."""
        return self.part.policy

    @property
    def divergence(self) -> Divergence | None:
        """The verdict behind the last divergence the engine handled."""
        return self.part.divergence

    def can_restore(self, trainer: pl.Trainer, step: int) -> bool:
        """A verified snapshot, or a verified checkpoint of a step at or before ``step``, exists (every rank agrees)."""
        return self.part.can_restore(trainer, step)

    # ------------------------------------------------------------------ lifecycle
    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        self.part.install(engine)

    @override
    def _uninstall(self, trainer: pl.Trainer) -> None:
        self.part.stop()

    # ------------------------------------------------------------------ state (counters only, no snapshots)
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.part.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.part.load_state_dict(state_dict)
