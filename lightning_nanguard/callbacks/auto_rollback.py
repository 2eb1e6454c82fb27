"""AutoRollback: drop a bad update before it lands and go back to the last verified-good training state."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import lightning.pytorch as pl
from torch.optim import Optimizer
from typing_extensions import override

from lightning_nanguard import _lightning_compat
from lightning_nanguard._validation import check_choice, check_int
from lightning_nanguard.callbacks._base import NanGuardCallback
from lightning_nanguard.callbacks._common import make_incident
from lightning_nanguard.callbacks._rollback_support import (
    Pending,
    exhausted_message,
    params_nonfinite,
    pending_from_request,
    rollback_message,
)
from lightning_nanguard.context import NanGuardContext, get_context
from lightning_nanguard.exceptions import NanGuardConfigError, RecoveryBudgetExhausted, UnsupportedSetupError
from lightning_nanguard.policies.rollback import RollbackPolicy, snapshot_due
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.recovery.final_checkpoint import checkpoint_dir, save_verified_checkpoint
from lightning_nanguard.recovery.rollback import restore_state
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.reporting import emit, keys
from lightning_nanguard.reporting.tb_purge import write_session_start

__all__ = ["AutoRollback"]


class AutoRollback(NanGuardCallback):
    """Keep verified-finite snapshots of the training state in memory; on a bad step, drop the update and restore.

    **Snapshots** are taken in ``on_train_batch_start`` (the state before that step's update; under DDP every rank
    snapshots on the same steps) every ``every_n_steps`` optimizer steps, into ``num_snapshots`` preallocated CPU
    buffers with foreach copies, and only when the parameters pass one fused finiteness check (one host read per
    snapshot, reduced across ranks) and no incident happened in the last ``quiet_steps`` steps. The optimizer state
    is checked when a snapshot is about to be restored (the rare path); a non-finite one is discarded.

    **Triggers**, decided in ``on_before_optimizer_step`` from the shared, rank-reduced step health: a non-finite loss
    or gradient (under an active GradScaler only when the parameters are non-finite too: an fp16 overflow is the
    scaler's routine, it drops the update and backs off; a collapse is LossScaleWatchdog's to report); non-finite
    parameters (seen at a snapshot step, or through the NaN loss they cause at the next step, e.g. fp16 AdamW eps
    underflow); a ``ctx.request(trainer, "rollback", ...)`` from another callback (a spike
    or loss-scale collapse; the requester drops the update). The update is dropped with ``ctx.skip_step``, and the
    newest good snapshot is restored in ``on_train_batch_end``. A trigger within ``recurrence_steps`` of the previous
    rollback restores an older snapshot; snapshots newer than the restored one are discarded. The batches between
    the snapshot and the incident are not replayed; ``skip_batches`` more batches then get no update (PaLM's recipe).

    **What rolls back**: parameters, buffers and the optimizer state (moments, step counts), copied in place. What
    does not: param-group hyperparameters (lr, eps: an ``OptimizerBackoff`` stays applied), schedulers (not rewound,
    like ``global_step``, so the schedule stays aligned), the GradScaler (it keeps ``min(current, snapshot)`` scale),
    the RNG (the data is not rewound, so fresh randomness is the better restart) and Lightning's loop counters.
    Every restore emits ``ctx.emit("restored", trainer, from_step=..., source="memory"|"disk")``.

    **Disk**: when no in-memory snapshot is usable, or with ``source="disk"``, the newest verified checkpoint in the
    ModelCheckpoint ``dirpath`` (else ``checkpoint_dir``) is loaded with public strategy calls, loops untouched;
    its lr/eps are ignored (the live ones win). **Budget**: more than ``max_rollbacks`` within ``rollback_window``
    steps restores once more, saves a verified checkpoint and stops with ``RecoveryBudgetExhausted``.
    **TensorBoard**: a ``SessionLog.START`` event at train start and at each rollback (step = the snapshot's logging
    step + 1: the snapshot step's own metrics were computed on its good weights) makes the abandoned steps disappear
    from the dashboard; the incident step's metrics, logged after the rollback, stay as its marker. Snapshots are not
    saved in checkpoints (the callback state is counters only).

    Args:
        every_n_steps: snapshot cadence in optimizer steps (50: about 0.1-0.3% of a step for a 25M-param model).
        num_snapshots: snapshots kept in memory (each costs 12 bytes/param with AdamW); 0 with ``source="disk"``.
        quiet_steps: no snapshot within this many steps after an incident.
        max_rollbacks: rollbacks allowed within ``rollback_window`` steps.
        rollback_window: the budget window, in optimizer steps.
        recurrence_steps: a trigger this soon after a rollback restores an older snapshot.
        skip_batches: batches after a rollback whose updates are dropped.
        source: ``"memory"`` (snapshots, disk as fallback) or ``"disk"`` (verified checkpoints only).
        checkpoint_dir: where verified checkpoints are found and the final one is written when no ModelCheckpoint
            is configured.

    Logged keys:
        ``nanguard/rollbacks``                 cumulative rollbacks, every logged step
        ``nanguard/restored_from_step``        the ``global_step`` of the restored state, at each rollback
        ``nanguard/rollback_skipped_batches``  cumulative batches skipped after rollbacks, every logged step
        ``nanguard/incident/rollback``         1.0 at each rollback (incident record with ``restored_from_step``)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at train start, with ``source="disk"`` and no checkpoint directory.
        RecoveryBudgetExhausted: at the end of training, when the rollback budget ran out.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AutoRollback(every_n_steps=50, max_rollbacks=5, skip_batches=100)])
    """

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
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, str):
            raise NanGuardConfigError(f"{owner}(checkpoint_dir={checkpoint_dir!r}): must be a str path or None.")
        self.every_n_steps = every_n_steps
        self.num_snapshots = num_snapshots
        self.quiet_steps = quiet_steps
        self.max_rollbacks = max_rollbacks
        self.rollback_window = rollback_window
        self.recurrence_steps = recurrence_steps
        self.skip_batches = skip_batches
        self.source = source
        self.checkpoint_dir = checkpoint_dir
        self.policy = RollbackPolicy(max_rollbacks, rollback_window, recurrence_steps)
        self.ring = SnapshotRing(num_snapshots if source == "memory" else 0, pin_memory=True)
        self.skipped_batches = 0
        self._skip_left = 0
        self._reset_fit_state()

    def _reset_fit_state(self) -> None:
        self._last_incident: int | None = None
        self._params_bad_at: int | None = None
        self._pending: dict[int, Pending] = {}  # step -> trigger, decided in on_before_optimizer_step
        self._handled: int | None = None  # the last step whose outcome was acted on
        self._skip_counted: int | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, source=self.source)

    @property
    def rollbacks(self) -> int:
        """Rollbacks so far, across resumes."""
        return self.policy.total

    # ------------------------------------------------------------------ lifecycle
    @override
    def _setup_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: NanGuardContext) -> None:
        self._reset_fit_state()
        ctx.subscribe("incident", self._on_incident)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.source == "disk" and checkpoint_dir(trainer, self.checkpoint_dir) is None:
            raise UnsupportedSetupError(
                "AutoRollback(source='disk') needs a checkpoint directory: configure a ModelCheckpoint with a dirpath "
                "or pass AutoRollback(checkpoint_dir=...)."
            )
        # Here, not in on_fit_start: the loops are restored by now, so on a resume this START also purges whatever
        # the interrupted run logged after its checkpoint.
        write_session_start(trainer, _lightning_compat.log_step(trainer))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.source != "memory" or not snapshot_due(
            step,
            every_n_steps=self.every_n_steps,
            last_snapshot_step=max(self.ring.steps(), default=None),
            last_incident_step=self._last_incident,
            quiet_steps=self.quiet_steps,
        ):
            return
        if params_nonfinite(trainer, pl_module):  # one fused pass and one host read per snapshot, reduced
            self._params_bad_at = step
            return
        scaler = _lightning_compat.get_scaler(trainer)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        self.ring.take(
            pl_module, trainer.optimizers, step=step, log_step=_lightning_compat.log_step(trainer), scale=scale
        )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        ctx = get_context(trainer)
        health = ctx.step_health(trainer, pl_module, optimizer)
        step, name = trainer.global_step, type(self).__name__
        requested = [r for r in ctx.outcome(trainer).requests if r.get("what") == "rollback"]
        if step in self._pending:
            pass  # another optimizer of the same (manual) step already decided
        elif health.bad and not health.scaler_active:  # bad_ranks is a collective; `bad` is reduced: all ranks here
            self._pending[step] = Pending(health.trigger(), health.bad_ranks(trainer), health.values())
        elif health.bad and params_nonfinite(trainer, pl_module):  # rare path: one fused pass, reduced
            self._pending[step] = Pending("nonfinite_params", health.bad_ranks(trainer), health.values())
        elif self._params_bad_at == step:
            self._pending[step] = Pending("nonfinite_params", list(range(trainer.world_size)))
        elif requested:
            self._pending[step] = pending_from_request(requested[0], trainer)
        if step in self._pending:
            ctx.skip_step(trainer, optimizer, health, name)
        elif self._skip_left > 0:
            ctx.skip_step(trainer, optimizer, health, name)
            if step != self._skip_counted:  # one count per optimizer step, however many optimizers
                self._skip_counted = step
                self._skip_left -= 1
                self.skipped_batches += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        out = get_context(trainer).last_outcome(trainer)
        step = out.step if out is not None else trainer.global_step - 1
        if out is not None and out.skipped:  # a dropped update is an incident: no snapshot for quiet_steps
            self._last_incident = max(self._last_incident or 0, out.step)
        requests = [r for r in out.requests if r.get("what") == "rollback"] if out is not None else []
        pending = self._pending.pop(step, None)
        if pending is None and requests and step != self._handled:
            pending = pending_from_request(requests[0], trainer)
        if pending is not None:
            self._handled = step
            self._pending.clear()
            self._rollback(trainer, pl_module, step, pending)
        if _lightning_compat.should_update_logs(trainer):
            pl_module.log(keys.ROLLBACKS, float(self.rollbacks), on_step=True, on_epoch=False)
            if self.skip_batches:
                pl_module.log(keys.ROLLBACK_SKIPPED_BATCHES, float(self.skipped_batches), on_step=True, on_epoch=False)

    @override
    def _teardown_fit(self, trainer: pl.Trainer) -> None:
        self.ring.clear()  # free the buffers; snapshots never outlive the fit

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

    # ------------------------------------------------------------------ internals
    def _on_incident(self, trainer: pl.Trainer, incident: Any) -> None:
        self._last_incident = max(self._last_incident or 0, int(incident.step))

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, pending: Pending) -> None:
        ctx = get_context(trainer)
        self._last_incident = step
        decision = self.policy.decide(step)
        dirpath = checkpoint_dir(trainer, self.checkpoint_dir)
        restored = restore_state(trainer, pl_module, self.ring, decision, dirpath)
        what, where = pending.trigger.replace("_", " "), f"global_step={step} (epoch {trainer.current_epoch})"
        values = dict(pending.values)
        if restored is None:
            message = f"{what} at {where}; update dropped, but there is no verified snapshot or checkpoint yet."
            self._record(trainer, step, pending, Action.SKIP, values, message)
            return
        self.policy.record(step, restored.step)
        self._skip_left = self.skip_batches
        write_session_start(trainer, restored.log_step + 1)  # the snapshot step's own metrics came from good weights
        emit.log_event(trainer, {keys.RESTORED_FROM_STEP: float(restored.step)})
        values.update(restored_from_step=restored.step, source=restored.source, steps_lost=step - restored.step)
        values.update(rollbacks=self.rollbacks, recurrence=decision.recurrence, checkpoint=restored.path)
        message = rollback_message(f"{what} at {where}", restored.step, restored.source, decision, self.policy)
        self._record(trainer, step, pending, Action.ROLLBACK, values, message)
        ctx.emit("restored", trainer, from_step=restored.step, source=restored.source)
        if not decision.exhausted:
            return
        path = save_verified_checkpoint(
            trainer,
            dirpath or os.path.join(trainer.default_root_dir, "checkpoints"),
            f"nanguard-final-step={step}.ckpt",
        )
        message = exhausted_message(
            f"{what} at {where}, ranks {pending.ranks}", restored.step, path, decision, self.policy
        )
        values = {"checkpoint": path, "restored_from_step": restored.step}
        self._record(trainer, step, Pending("rollback_budget_exhausted", pending.ranks), Action.STOP, values, message)
        ctx.request_stop(trainer, RecoveryBudgetExhausted(message))

    def _record(
        self, trainer: pl.Trainer, step: int, pending: Pending, action: Action, values: dict[str, Any], message: str
    ) -> None:
        incident = make_incident(
            trainer,
            trigger=pending.trigger,
            action=action,
            source=type(self).__name__,
            ranks=pending.ranks,
            values=values,
            budget_left=self.policy.budget_left,
            message=message,
        )
        get_context(trainer).record(trainer, dataclasses.replace(incident, step=step))
