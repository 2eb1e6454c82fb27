"""AutoRollback's part: the snapshot ring, the judgement of its snapshots, their learning rates and the probe batch,
as one ``Restorer`` the engine drives (``engine/capabilities.py``) and one part (``engine/parts.py``: its train
start). ``callbacks/auto_rollback.py`` only configures it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from lightning_nanguard import _lightning_compat
from lightning_nanguard.checkpointing.final import checkpoint_dir, require_checkpoint_dir, save_final_checkpoint
from lightning_nanguard.config import AutoRollbackConfig
from lightning_nanguard.contract import Divergence, PassedOverSnapshots
from lightning_nanguard.engine import Engine
from lightning_nanguard.engine.capabilities import Restored
from lightning_nanguard.engine.incidents import EventHandled
from lightning_nanguard.engine.state_check import model_finite
from lightning_nanguard.policies.causes import trusts_state
from lightning_nanguard.policies.probe import ProbeVerdict
from lightning_nanguard.policies.rollback import RollbackPolicy
from lightning_nanguard.policies.snapshot_health import History, SnapshotBook
from lightning_nanguard.policies.snapshot_rates import RestoredRates, SnapshotRates
from lightning_nanguard.recovery.disk_restore import has_rollback_checkpoint
from lightning_nanguard.recovery.probe import SnapshotProbe
from lightning_nanguard.recovery.probe_weights import snapshot_weights
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.recovery.rollback import repair_buffers, restore_state
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.recovery.snapshot_stats import parameter_max_abs
from lightning_nanguard.reporting import keys
from lightning_nanguard.signals.loss_climb import LossTrend

__all__ = ["Rollback"]


class Rollback:
    """The ring, the book, the rates and the probe of one AutoRollback, and the rollback budget (``policy``)."""

    def __init__(self, config: AutoRollbackConfig, owner: str) -> None:
        c = self.config = config
        self.owner = owner
        self.policy = RollbackPolicy(c.max_rollbacks, c.rollback_window, c.recurrence_steps, c.skip_batches)
        self.book = SnapshotBook(c.every_n_steps, c.quiet_steps)
        self.ring = SnapshotRing(
            c.num_snapshots if c.source == "memory" else 0, pin_memory=True, max_bytes=c.max_snapshot_bytes
        )
        self.divergence: Divergence | None = None  # the verdict behind the last ``diverging()`` that answered True
        self.probe = SnapshotProbe()  # scored at each snapshot and spike where spikes are probed
        self.rates = SnapshotRates()  # the learning rates each kept snapshot was taken and trained at
        self._engine: Engine | None = None

    # ------------------------------------------------------------------ the fit
    def install(self, engine: Engine) -> None:
        """A new fit: its own budget (a callback reused by another Trainer; a resume's state is loaded after this),
        registered as the engine's restorer and as a part."""
        self._engine = engine
        c = self.config
        self.policy = RollbackPolicy(c.max_rollbacks, c.rollback_window, c.recurrence_steps, c.skip_batches)
        self.book.reset()
        self.divergence = None
        self.rates.reset()
        engine.set_restorer(self)
        engine.bus.subscribe(EventHandled, self._on_event)
        engine.add_metrics(self._metrics)
        engine.add_part(self)

    def train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Its part's: every slot allocated now, outside the training steps; the probe started where spikes are
        probed."""
        if self.config.source == "disk":
            require_checkpoint_dir(trainer, self.config.checkpoint_dir, "AutoRollback(source='disk')")
        else:
            self.ring.prepare(trainer, pl_module, trainer.optimizers)
        guard = self._engine.registry.guard if self._engine is not None else None
        self.probe.start(trainer, self.config.source == "memory" and guard is not None and guard.on_spike == "probe")

    def stop(self) -> None:
        self.ring.clear()  # free the buffers; snapshots never outlive the fit

    # ------------------------------------------------------------------ the engine's Restorer
    def before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, batch: object) -> bool:
        if (book := self.book).busy:  # a snapshot to judge, or a suspect's trend to follow
            book.diverging = book.score(step, self._history(), self.ring.steps())
        rate = _rate_of(trainer)  # the rate this step will run with
        # Periodically, and before the first step at a rate that jumped (a restart, a schedule's step): the state
        # that trained at the old rate is the one a divergence at the new one goes back to.
        jumped = self.rates.jumped(rate)
        due = self.ring.incomplete or (
            (jumped or not step % self.config.every_n_steps) and book.due(step, self.ring.steps(), jumped=jumped)
        )
        if (
            self.config.source != "memory" or not due
        ):  # ring.incomplete: the last snapshot predates a lazy layer's forward
            self.rates.observe(rate)
            return True  # the healthy path: not a snapshot step
        if not model_finite(trainer, pl_module):  # one fused pass and one host read per snapshot, reduced
            book.diverging = False  # the non-finite state is the event; its restore passes over the snapshot anyway
            return False
        scale, log_step = _lightning_compat.current_scale(trainer), _lightning_compat.log_step(trainer)
        keep = book.keep(self.ring.steps())
        self.ring.take(pl_module, trainer.optimizers, step=step, log_step=log_step, scale=scale, keep=keep)
        book.taken(step, self.ring.steps())
        self.rates.snapshot(step, rate, self.ring.steps())
        self.rates.observe(rate)
        self.probe.snapshot_taken(trainer, pl_module, step, batch, self._quarantine())
        return True

    def probe_spike(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        batch_loss: float | None,
        trend: LossTrend | None = None,
    ) -> ProbeVerdict | None:
        verdict = self.probe.spike(
            trainer,
            pl_module,
            step,
            self.ring.steps(),
            self._quarantine(),
            batch_loss,
            lambda kept: snapshot_weights(self.ring, kept, trainer, pl_module),
            trend,
        )
        if verdict is not None and verdict.rose:  # taken during the climb: a restore passes over them
            self.book.judge.unsound.update(verdict.unsound)
        return verdict

    @property
    def probe_verdict(self) -> ProbeVerdict | None:
        return self.probe.verdict

    def rates_at(self, step: int) -> RestoredRates:
        """The rates the kept snapshots up to ``step`` were taken and trained at (``policies.snapshot_rates``)."""
        return self.rates.at(step)

    def can_restore(self, trainer: pl.Trainer, step: int) -> bool:
        """A verified snapshot, or a verified checkpoint of a step at or before ``step``, exists (every rank agrees)."""
        dirpath = checkpoint_dir(trainer, self.config.checkpoint_dir)
        return bool(self.ring.steps()) or has_rollback_checkpoint(trainer, dirpath, at_or_before_step=step)

    def budget_left(self, step: int) -> int:
        return self.policy.budget_left_at(step)

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Restored | None:
        self.book.settle(step, self._history(), self.ring.steps())  # passing over a suspect snapshot
        decision = self.policy.decide(step)
        dirpath, unsound = checkpoint_dir(trainer, self.config.checkpoint_dir), self.book.judge.unsound
        restored = restore_state(
            trainer, pl_module, self.ring, decision, dirpath, at_or_before_step=step, unsound=unsound
        )
        if restored is None:
            return None
        self.policy.record(step, restored.step)
        self.book.restored(step, restored.step)
        self.probe.restored(restored.step)
        self.rates.restored(restored.step)
        if restored.passed_over and self._engine is not None:
            self._engine.bus.emit(trainer, PassedOverSnapshots(restored.step, restored.passed_over))
        recurrence, in_window = decision.recurrence, decision.in_window
        return Restored(restored.step, restored.source, restored.path, recurrence, in_window)

    def repair_buffers(self, trainer: pl.Trainer, pl_module: pl.LightningModule, names: list[str]) -> Restored | None:
        done = repair_buffers(self.ring, pl_module, names) if self.config.source == "memory" else None
        return None if done is None else Restored(done.step, done.source, repaired=tuple(names))

    def diverging(self) -> bool:
        """True once, when the readings after a suspect snapshot kept growing (``divergence``: that snapshot). From the
        engine's rank-reduced history: every rank answers the same."""
        if not self.book.diverging:
            return False
        self.book.diverging = False
        self.divergence = self.book.reported
        return True

    def skip_batch(self) -> bool:
        return self.policy.skip_batch()

    def sound_reference(self, names: set[str]) -> tuple[int, dict[str, float]] | None:
        """The newest snapshot judged sound and its parameters' largest |value| (incident path only)."""
        step = self.book.keep(self.ring.steps()) if self.config.source == "memory" else None
        snapshot = self.ring.get(step) if step is not None else None
        return None if snapshot is None or step is None else (step, parameter_max_abs(snapshot, names))

    def save_final(self, trainer: pl.Trainer, step: int) -> str:
        """A verified checkpoint of the (restored, finite) state before a budget stop. Every rank calls it."""
        return save_final_checkpoint(trainer, self.config.checkpoint_dir, step)

    def _quarantine(self) -> Quarantine | None:
        return self._engine.registry.quarantine if self._engine is not None else None

    def _history(self) -> History:
        return self._engine.history if self._engine is not None else ()

    def _on_event(self, trainer: pl.Trainer, event: EventHandled) -> None:
        if not trusts_state(event.incident.cause):
            self.book.distrust(event.step)

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        skipped = (
            {keys.ROLLBACK_SKIPPED_BATCHES: float(self.policy.skipped_batches)} if self.config.skip_batches else {}
        )
        return {keys.ROLLBACKS: float(self.policy.total), **skipped}

    # ------------------------------------------------------------------ state (counters only, no snapshots)
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **self.policy.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict)


def _rate_of(trainer: pl.Trainer) -> float | None:
    """The first optimizer's first param group's learning rate, where it is a host number (never a device read)."""
    groups = trainer.optimizers[0].param_groups if trainer.optimizers else []
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, (int, float)) else None
