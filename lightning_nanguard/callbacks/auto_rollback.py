"""AutoRollback: keep verified-good training states, and restore one when the state is damaged or training diverges."""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard._validation import check_choice, check_int, check_path
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.checkpoints import last_good_checkpoint
from lightning_nanguard.contract import Divergence, PassedOverSnapshots, StepHealth
from lightning_nanguard.engine import Engine
from lightning_nanguard.engine.capabilities import Restored
from lightning_nanguard.engine.incidents import EventHandled
from lightning_nanguard.engine.state_check import model_finite
from lightning_nanguard.exceptions import NanGuardConfigError, UnsupportedSetupError
from lightning_nanguard.policies.causes import trusts_state
from lightning_nanguard.policies.rollback import RollbackPolicy, SnapshotJudge, diverging_now, snapshot_due
from lightning_nanguard.recovery.final_checkpoint import checkpoint_dir, save_verified_checkpoint
from lightning_nanguard.recovery.rollback import restore_state
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.reporting import keys

__all__ = ["AutoRollback"]


class AutoRollback(NanGuardCallback):
    """Keep verified-finite snapshots of the training state in memory; restore one when the state is damaged or
    training diverges.

    **Snapshots** are taken in ``on_train_batch_start`` (the state before that step's update; under DDP every rank
    snapshots on the same steps) every ``every_n_steps`` optimizer steps, into ``num_snapshots`` preallocated CPU
    buffers with foreach copies, and only when the parameters and buffers pass one fused finiteness check (one host
    read per snapshot, reduced across ranks) and no incident that distrusts the state happened in the last
    ``quiet_steps`` steps. A snapshot check that finds non-finite parameters or buffers is itself an incident.

    **When** the engine's remedy policy plans it (see the README's table): the state is damaged (non-finite
    parameters, buffers such as BatchNorm statistics, or optimizer state), training diverges (a gradient explosion, a
    spike with ``GradNormMonitor(on_spike="rollback")``, a loss-scale collapse), or too many updates were dropped in a
    row. A bad sample whose update was dropped with the state intact is *not* rolled back. The newest good snapshot
    is restored in ``on_train_batch_end``; a trigger within ``recurrence_steps`` of the previous rollback restores an
    older one; snapshots newer than the restored one are discarded.

    **Finite is not good**: a run diverging slowly is finite for many steps while its loss grows by orders of
    magnitude, and a snapshot taken then is a state no learning rate brings back. So each snapshot is judged, a step
    later, by the engine's reading of its own step (loss and gradient norm of exactly those weights, host floats the
    engine already has: no extra device read). One whose gradient norm and loss are both more than 10x those of the
    last sound snapshot was taken mid-divergence: a restore passes over it (an older sound one is restored; a
    planned learning-rate backoff goes one notch further for each one passed over, the recurrence restoring it would
    have met), and the ring never evicts the last sound snapshot for it. A level that holds for a whole interval with
    no incident is a new normal, not a divergence. The snapshot just taken being judged so, with the median of the
    steps up to it also 10x the median of the steps after the last sound one (not one odd batch on either side), is
    itself an event (``diverging``): training is diverging *now*, often many steps before anything goes non-finite,
    and the engine handles it at that batch's start (a rollback past it and a learning-rate backoff, like a gradient
    explosion). After a rollback, ``skip_batches`` more batches get no update (PaLM's recipe). At the end of fit,
    non-finite parameters or buffers left by the last update are restored too, so a fit that returns has finite
    weights.

    **What rolls back**: parameters, buffers and the optimizer state (moments, step counts), copied in place. What
    does not: param-group hyperparameters (lr, eps: an ``OptimizerBackoff`` stays applied), schedulers (not rewound,
    like ``global_step``, so the schedule stays aligned), the GradScaler (it keeps ``min(current, snapshot)`` scale),
    the RNG (the data is not rewound, so fresh randomness is the better restart) and Lightning's loop counters.

    **Disk**: when no in-memory snapshot is usable, or with ``source="disk"``, the newest verified checkpoint in the
    ModelCheckpoint ``dirpath`` (else ``checkpoint_dir``) is loaded (weights-only), loops untouched; its lr/eps are
    ignored (the live ones win). **Budget**: more than ``max_rollbacks`` within ``rollback_window`` steps restores
    once more, saves a verified checkpoint and stops with ``RecoveryBudgetExhausted``; with nothing verified to
    restore, a damaged state stops training with ``NonFiniteTrainingError`` instead of training on.

    Args:
        every_n_steps: snapshot cadence in optimizer steps (50: about 0.1-0.3% of a step for a 25M-param model).
        num_snapshots: snapshots kept in memory (each costs 12 bytes/param with AdamW); 0 with ``source="disk"``.
        quiet_steps: no snapshot within this many steps after an incident that distrusts the state.
        max_rollbacks: rollbacks allowed within ``rollback_window`` steps.
        rollback_window: the budget window, in optimizer steps.
        recurrence_steps: a trigger this soon after a rollback restores an older snapshot.
        skip_batches: batches after a rollback whose updates are dropped.
        source: ``"memory"`` (snapshots, disk as fallback) or ``"disk"`` (verified checkpoints only).
        checkpoint_dir: where verified checkpoints are found and the final one is written when no ModelCheckpoint
            is configured.

    Logged keys:
        ``nanguard/rollbacks``                 cumulative rollbacks, every logged step
        ``nanguard/rollback_skipped_batches``  cumulative batches skipped after rollbacks, every logged step
        ``nanguard/incident/rollback``         1.0 at each rollback (the incident names ``restored_from_step``)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at train start, with ``source="disk"`` and no checkpoint directory.
        RecoveryBudgetExhausted: at the end of training, when the rollback budget ran out.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AutoRollback(every_n_steps=50, max_rollbacks=5, skip_batches=100)])
    """

    owner = "AutoRollback"

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
    ) -> None:
        owner = type(self).__name__
        check_int(owner, "every_n_steps", every_n_steps, minimum=1)
        check_int(owner, "num_snapshots", num_snapshots, minimum=0)
        for name, value in (("quiet_steps", quiet_steps), ("recurrence_steps", recurrence_steps)):
            check_int(owner, name, value, minimum=0)
        check_int(owner, "skip_batches", skip_batches, minimum=0)
        check_int(owner, "max_rollbacks", max_rollbacks, minimum=1)
        check_int(owner, "rollback_window", rollback_window, minimum=1)
        check_choice(owner, "source", source, ("memory", "disk"))
        if source == "memory" and num_snapshots == 0:
            raise NanGuardConfigError(f"{owner}(num_snapshots=0): must be >= 1 with source='memory'.")
        check_path(owner, "checkpoint_dir", checkpoint_dir)
        if source == "disk" and checkpoint_dir is not None and not os.path.isdir(checkpoint_dir):
            raise NanGuardConfigError(
                f"{owner}(source='disk', checkpoint_dir={os.fspath(checkpoint_dir)!r}): must be an existing directory "
                "(the verified checkpoints a rollback restores from). Leave checkpoint_dir unset to use "
                "ModelCheckpoint's dirpath."
            )
        self.every_n_steps = every_n_steps
        self.num_snapshots = num_snapshots
        self.quiet_steps = quiet_steps
        self.max_rollbacks = max_rollbacks
        self.rollback_window = rollback_window
        self.recurrence_steps = recurrence_steps
        self.skip_batches = skip_batches
        self.source = source
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.policy = RollbackPolicy(max_rollbacks, rollback_window, recurrence_steps)
        self.ring = SnapshotRing(num_snapshots if source == "memory" else 0, pin_memory=True)
        self.skipped_batches = 0
        self._skip_left = 0
        self._last_event: int | None = None
        self.judge = SnapshotJudge()
        self._unscored: list[int] = []  # snapshots whose step reading has not reached the engine's history yet
        self._diverging = False  # the snapshot just judged was taken mid-divergence: not reported to the engine yet
        self.divergence: Divergence | None = None  # the verdict behind the last ``diverging()`` that answered True
        self._engine: Engine | None = None

    @override
    def _make_state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, source=self.source)

    @property
    def rollbacks(self) -> int:
        """Rollbacks so far, across resumes."""
        return self.policy.total

    # ------------------------------------------------------------------ lifecycle
    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        self._last_event = None
        self._engine = engine
        self.judge.reset()
        self._unscored = []
        self._diverging, self.divergence = False, None
        engine.set_restorer(self)
        engine.bus.subscribe(EventHandled, self._on_event)
        engine.add_metrics(self._metrics)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.source == "disk" and checkpoint_dir(trainer, self.checkpoint_dir) is None:
            raise UnsupportedSetupError(
                "AutoRollback(source='disk') needs a checkpoint directory: configure a ModelCheckpoint with a dirpath "
                "or pass AutoRollback(checkpoint_dir=...)."
            )
        super().on_train_start(trainer, pl_module)

    @override
    def _uninstall(self, trainer: pl.Trainer) -> None:
        self.ring.clear()  # free the buffers; snapshots never outlive the fit

    # ------------------------------------------------------------------ the engine's Restorer
    def before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> bool:
        if self._unscored:
            self._diverging = self._score(step)
        if self.source != "memory" or step % self.every_n_steps:
            return True  # the healthy path: not a snapshot step
        if not snapshot_due(
            step,
            every_n_steps=self.every_n_steps,
            last_snapshot_step=max(self.ring.steps(), default=None),
            last_incident_step=self._last_event,
            quiet_steps=self.quiet_steps,
        ):
            return True
        if not model_finite(trainer, pl_module):  # one fused pass and one host read per snapshot, reduced
            self._diverging = False  # the non-finite state is the event; its restore passes over the snapshot anyway
            return False
        scaler = _lightning_compat.get_scaler(trainer)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        # The newest sound snapshot stays in the ring while the ones after it were taken mid-divergence.
        keep = max((s for s in self.ring.steps() if s not in self.judge.unsound), default=None)
        self.ring.take(
            pl_module,
            trainer.optimizers,
            step=step,
            log_step=_lightning_compat.log_step(trainer),
            scale=scale,
            keep=keep,
        )
        self.judge.keep_only(self.ring.steps())
        self._unscored.append(step)
        return True

    def _score(self, now: int) -> bool:
        """Judge snapshots by the engine's reading of their own step (host floats it keeps anyway; no device read).

        Returns whether the newest snapshot in the ring was just judged taken mid-divergence and the steps around it
        and the last sound one confirm it (``diverging_now``): the run is diverging now. The readings are
        rank-reduced, so every rank returns the same."""
        history = self._engine.history if self._engine is not None else ()
        pending, self._unscored = self._unscored, []
        newest = history[-1][0] if history else -1
        latest = max(self.ring.steps(), default=None)
        diverging = False
        for step in pending:
            found = next((StepHealth(float(g), loss) for s, g, loss in history if s == step), None)
            if found is None and newest <= step and now - step <= self.every_n_steps:
                self._unscored.append(step)  # not read yet (the device path reports a step late)
                continue
            # No finite reading of that step (or none at all): nothing says the snapshot is unsound.
            prev = self.judge.previous_step
            quiet = self._last_event is None or prev is None or self._last_event < prev
            sound = self.judge.judge(step, found, incident_since_previous=not quiet)
            if not sound and step == latest and self.judge.last_divergence is not None:
                diverging = diverging_now(self.judge.last_divergence, history)
        return diverging

    def can_restore(self, trainer: pl.Trainer, step: int) -> bool:
        """A verified snapshot, or a verified checkpoint of a step at or before ``step``, exists (every rank agrees:
        rank 0 looks at the files and broadcasts; a collective, on the incident path only)."""
        if self.ring.steps():
            return True
        dirpath = checkpoint_dir(trainer, self.checkpoint_dir)
        found = (  # files only, as the disk restore loads them (a distributed checkpoint directory it cannot)
            dirpath is not None
            and trainer.is_global_zero
            and last_good_checkpoint(dirpath, at_or_before_step=step, directories=False)
        )
        return bool(_distributed.broadcast_object(trainer, bool(found)))

    def budget_left(self, step: int) -> int:
        recent = [s for s in self.policy.history if step - s < self.policy.window]
        return max(0, self.max_rollbacks - len(recent))

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> Restored | None:
        self._diverging = False  # this restore answers it (passing over the snapshot judged so)
        if self._unscored:
            self._score(step)
        decision = self.policy.decide(step)
        dirpath = checkpoint_dir(trainer, self.checkpoint_dir)
        restored = restore_state(
            trainer, pl_module, self.ring, decision, dirpath, at_or_before_step=step, unsound=self.judge.unsound
        )
        if restored is None:
            return None
        self.policy.record(step, restored.step)
        self.judge.restored(restored.step)
        self._unscored = [s for s in self._unscored if s <= restored.step]
        if restored.passed_over and self._engine is not None:
            self._engine.bus.emit(trainer, PassedOverSnapshots(restored.step, restored.passed_over))
        self._skip_left = self.skip_batches
        self._last_event = step
        return Restored(
            step=restored.step,
            source=restored.source,
            path=restored.path,
            recurrence=decision.recurrence,
            in_window=decision.in_window,
        )

    def diverging(self) -> bool:
        """True once, right after the snapshot just taken was judged taken mid-divergence (``divergence`` then says
        what was seen). Judged from the engine's rank-reduced history: every rank answers the same. The healthy path
        is one attribute check."""
        if not self._diverging:
            return False
        self._diverging = False
        self.divergence = self.judge.last_divergence
        return True

    def skip_batch(self) -> bool:
        if self._skip_left <= 0:
            return False
        self._skip_left -= 1
        self.skipped_batches += 1
        return True

    def save_final(self, trainer: pl.Trainer, step: int) -> str:
        """A verified checkpoint of the (restored, finite) state before a budget stop. Every rank calls it."""
        dirpath = checkpoint_dir(trainer, self.checkpoint_dir) or os.path.join(trainer.default_root_dir, "checkpoints")
        return save_verified_checkpoint(trainer, dirpath, f"nanguard-final-step={step}.ckpt")

    def _on_event(self, trainer: pl.Trainer, event: EventHandled) -> None:
        if not trusts_state(event.incident.cause):
            self._last_event = max(self._last_event or 0, event.step)

    def _metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        out = {keys.ROLLBACKS: float(self.rollbacks)}
        if self.skip_batches:
            out[keys.ROLLBACK_SKIPPED_BATCHES] = float(self.skipped_batches)
        return out

    # ------------------------------------------------------------------ state (counters only, no snapshots)
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "rollbacks": self.policy.total,
            "history": list(self.policy.history),
            "last_restored_step": self.policy.last_restored_step,
            "skipped_batches": self.skipped_batches,
            "skip_left": self._skip_left,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.total = int(state_dict.get("rollbacks", 0))
        self.policy.history = [int(s) for s in state_dict.get("history", [])]
        last = state_dict.get("last_restored_step")
        self.policy.last_restored_step = None if last is None else int(last)
        self.skipped_batches = int(state_dict.get("skipped_batches", 0))
        self._skip_left = int(state_dict.get("skip_left", 0))
