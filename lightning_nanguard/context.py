"""The per-Trainer state nanguard callbacks share: one health reading per step, the step's outcome, the incidents.

Callbacks never talk to each other directly and never depend on their order in ``Trainer(callbacks=[...])``:

* the first nanguard callback to ask for a step's health computes it (one fused pass, one cross-rank reduction);
  every other callback gets the cached reading;
* dropping a step's update is idempotent (``skip_step``), so two callbacks that both want it act once;
* incidents go to one log (``record``), and every subscriber to ``"incident"`` hears of them at once, whichever
  callback recorded them, so a reaction (a backoff after a rollback) does not depend on hook order;
* a stop is requested with its error (``request_stop``); the error is raised once, at the end of training, after
  Lightning has finished the epoch and written its checkpoints from the (finite) weights.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.recovery.step_skip import drop_update
from lightning_nanguard.reporting import emit
from lightning_nanguard.reporting.incidents import Incident, IncidentLog
from lightning_nanguard.reporting.keys import key
from lightning_nanguard.reporting.summary import format_summary
from lightning_nanguard.signals.gradients import GradReading, ParamIndex, grad_reading

__all__ = ["NanGuardContext", "StepHealth", "StepOutcome", "get_context"]

INCIDENTS_FILE = os.path.join("nanguard", "incidents.jsonl")


@dataclass
class StepHealth:
    """The health of one optimizer step, identical on every rank in its verdict (``bad``).

    ``grads`` holds device tensors (no host read was spent on them); ``bad`` is the one reduced host value.
    """

    step: int
    optimizer_idx: int
    grads: GradReading | None
    loss: Tensor | None  # sum of this step's (micro-batch) losses as seen by on_before_backward, detached
    loss_finite: Tensor | None  # 0-d bool
    local_bad: Tensor | bool  # this rank's verdict, before the reduction
    bad: bool  # True on every rank if any rank's step is non-finite
    scaler_active: bool
    fused_with_scaler: bool
    flags: dict[str, bool] = field(default_factory=dict)  # registered detectors' verdicts, reduced like ``bad``
    _ranks: list[int] | None = None

    def bad_ranks(self, trainer: pl.Trainer) -> list[int]:
        """Ranks whose local reading was bad. A collective: call it on every rank, only when ``bad``."""
        if self._ranks is None:
            self._ranks = _distributed.bad_ranks(trainer, self.local_bad)
        return self._ranks

    def trigger(self) -> str:
        """What was non-finite, for incident records (one host read; incident path only)."""
        loss_bad = self.loss_finite is not None and not bool(self.loss_finite.item())
        grads_bad = self.grads is not None and bool(self.grads.nonfinite.item() > 0)
        if loss_bad and grads_bad:
            return "nonfinite_loss_and_grads"
        if loss_bad:
            return "nonfinite_loss"
        if grads_bad:
            return "nonfinite_grads"
        return "nonfinite_on_other_rank"

    def values(self) -> dict[str, Any]:
        """The readings as plain floats, for incident records (host reads; incident path only)."""
        out: dict[str, Any] = {}
        if self.loss is not None:
            out["loss"] = float(self.loss.item())
        if self.grads is not None:
            out["grad_norm"] = float(self.grads.total_norm.item())
            out["nonfinite_grads"] = int(self.grads.nonfinite.item())
        return out


@dataclass
class StepOutcome:
    """What nanguard did about one optimizer step, filled in ``on_before_optimizer_step``."""

    step: int
    batch: int = -1  # _lightning_compat.batch_counter when created: the batch this outcome belongs to
    skipped: bool = False
    skipped_by: str = ""
    how: str = ""
    trigger: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)


class NanGuardContext:
    """Shared, per-Trainer nanguard state. Get it with ``get_context(trainer)``; never construct it directly."""

    def __init__(self) -> None:
        self.incidents = IncidentLog()
        self.log_dir: str | None = None
        self.users: set[str] = set()
        self._setup_done = False
        self._indexes: dict[int, ParamIndex] = {}
        self._health: dict[tuple[int, int], StepHealth] = {}
        self._outcomes: dict[int, StepOutcome] = {}
        self._loss_sum: Tensor | None = None
        self._loss_finite: Tensor | None = None
        self._last_loss: Tensor | None = None
        self._listeners: dict[str, list[Callable[..., None]]] = {}
        self._pending_error: BaseException | None = None
        self._finished = False
        self._depths: dict[str, int] = {}
        self._detectors: dict[str, Callable[[GradReading | None, Tensor | None], Tensor | bool]] = {}
        self.skipped_steps = 0  # updates dropped during this fit (by any nanguard callback or the GradScaler)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, user: str) -> None:
        """Called from every nanguard callback's ``setup`` (on every rank). Resolves the log dir once per fit."""
        self.users.add(user)
        if self._setup_done:
            return
        self._setup_done = True
        self._finished = False
        self._pending_error = None
        self.skipped_steps = 0
        self.incidents = IncidentLog()
        log_dir = trainer.log_dir  # a broadcast: every rank calls it here, once
        if trainer.is_global_zero and log_dir is not None:
            self.log_dir = log_dir
            self.incidents.path = os.path.join(log_dir, INCIDENTS_FILE)

    def teardown(self) -> None:
        """Forget per-fit state so that a later ``fit``/``validate`` on the same Trainer starts clean."""
        self._setup_done = False
        self._detectors.clear()
        self._indexes.clear()
        self._health.clear()
        self._outcomes.clear()
        self._reset_loss()

    def add_detector(self, name: str, fn: Callable[[GradReading | None, Tensor | None], Tensor | bool]) -> None:
        """Register an on-device test evaluated with every step's health: ``fn(grads, loss) -> 0-d bool tensor``.

        Its verdict is reduced across ranks together with the non-finite verdict (one all-reduce, one host read for
        all of them) and read back as ``health.flags[name]``. It must not read the host itself.
        """
        self._detectors[name] = fn

    def subscribe(self, event: str, fn: Callable[..., None]) -> None:
        """Call ``fn(trainer, **payload)`` whenever ``event`` is emitted. Events: ``"incident"``, ``"restored"``."""
        fns = self._listeners.setdefault(event, [])
        if fn not in fns:
            fns.append(fn)

    def emit(self, event: str, trainer: pl.Trainer, **payload: Any) -> None:
        for fn in list(self._listeners.get(event, [])):
            fn(trainer, **payload)

    # ------------------------------------------------------------------ sensing
    def observe_loss(self, loss: Tensor) -> None:
        """Record a (micro-batch) loss from ``on_before_backward``. Idempotent when several callbacks forward it."""
        if loss is self._last_loss:
            return
        self._last_loss = loss
        value = loss.detach().float()
        finite = torch.isfinite(value).all()
        total = value.sum()
        if self._loss_sum is None or self._loss_finite is None:
            self._loss_sum, self._loss_finite = total, finite
        else:
            self._loss_sum = self._loss_sum + total
            self._loss_finite = self._loss_finite & finite

    def step_health(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> StepHealth:
        """The step's health, computed on first request and cached. Call from ``on_before_optimizer_step``."""
        opt_idx = _optimizer_index(trainer, optimizer)
        cache_key = (trainer.global_step, opt_idx)
        cached = self._health.get(cache_key)
        if cached is not None:
            return cached
        self._health.clear()  # keep only the current step's readings
        index = self._param_index(pl_module, optimizer, opt_idx)
        scaler = _lightning_compat.get_scaler(trainer)
        scaler_active = scaler is not None and scaler.is_enabled()
        fused_with_scaler = scaler_active and _lightning_compat.optimizer_handles_unscaling(optimizer)
        scale = _lightning_compat.scale_tensor(scaler) if fused_with_scaler else None
        grads = grad_reading(index, scale=scale)
        local_bad: Tensor | bool = False
        if grads is not None:
            local_bad = ~torch.isfinite(grads.total_norm)
        if self._loss_finite is not None:
            loss_bad = ~self._loss_finite.to(grads.total_norm.device if grads is not None else "cpu")
            local_bad = loss_bad if isinstance(local_bad, bool) else (local_bad | loss_bad)
        # Registered detectors (e.g. a spike test) return on-device flags that ride on the same reduction and the
        # same single host read as the non-finite verdict.
        names = list(self._detectors)
        local_flags = [self._detectors[n](grads, self._loss_sum) for n in names]
        verdicts = _distributed.any_rank_each(trainer, [local_bad, *local_flags])
        health = StepHealth(
            step=trainer.global_step,
            optimizer_idx=opt_idx,
            grads=grads,
            loss=self._loss_sum,
            loss_finite=self._loss_finite,
            local_bad=local_bad,
            bad=verdicts[0],
            scaler_active=scaler_active,
            fused_with_scaler=fused_with_scaler,
            flags=dict(zip(names, verdicts[1:], strict=True)),
        )
        self._reset_loss()
        self._health[cache_key] = health
        self.outcome(trainer)  # every checked step gets its own outcome record
        return health

    def param_index(self, pl_module: pl.LightningModule, optimizer: Optimizer, opt_idx: int) -> ParamIndex:
        return self._param_index(pl_module, optimizer, opt_idx)

    # ------------------------------------------------------------------ acting
    def outcome(self, trainer: pl.Trainer) -> StepOutcome:
        """The outcome record of the current optimizer step (created on first use)."""
        step = trainer.global_step
        out = self._outcomes.get(step)
        if out is None:
            self._outcomes.clear()
            out = self._outcomes[step] = StepOutcome(step=step, batch=_lightning_compat.batch_counter(trainer))
        return out

    def last_outcome(self, trainer: pl.Trainer) -> StepOutcome | None:
        """The outcome of the optimizer step taken in the current batch, for ``on_train_batch_end`` (where
        ``global_step`` has already moved on). ``None`` when this batch took no step or nothing was recorded for it,
        so an older step's outcome is never mistaken for this one's."""
        out = next(iter(self._outcomes.values()), None)
        if out is None or out.batch != _lightning_compat.batch_counter(trainer):
            return None
        return out

    def skip_step(self, trainer: pl.Trainer, optimizer: Optimizer, health: StepHealth, source: str) -> bool:
        """Drop this step's update (idempotent; every rank must call it on the same steps). True if newly skipped."""
        out = self.outcome(trainer)
        if out.skipped:
            return False
        # This rank's own gradients decide how to drop the update (the GradScaler looks at them, not at the verdict).
        grads_finite = health.grads is None or bool(torch.isfinite(health.grads.total_norm).item())
        out.how = drop_update(
            optimizer,
            scaler_active=health.scaler_active,
            fused_with_scaler=health.fused_with_scaler,
            grads_finite=grads_finite,
        )
        out.skipped, out.skipped_by = True, source
        self.skipped_steps += 1
        return True

    def request(self, trainer: pl.Trainer, what: str, **details: Any) -> None:
        """Ask for an action another callback performs (``what="rollback"`` is read by AutoRollback)."""
        self.outcome(trainer).requests.append({"what": what, **details})

    def request_stop(self, trainer: pl.Trainer, error: BaseException) -> None:
        """Stop after this batch (all ranks) and raise ``error`` at the end of training. The first request wins."""
        trainer.should_stop = True
        if self._pending_error is None:
            self._pending_error = error

    # ------------------------------------------------------------------ reporting
    def record(self, trainer: pl.Trainer, incident: Incident) -> None:
        """Log an incident everywhere (jsonl on rank 0, loggers, TensorBoard text) and tell the subscribers."""
        self.incidents.add(incident)
        emit.log_event(trainer, {key("incident", incident.action): 1.0})
        emit.log_text(trainer, key("incidents"), _incident_markdown(incident))
        self.emit("incident", trainer, incident=incident)

    def finish(self, trainer: pl.Trainer, *, raise_pending: bool) -> None:
        """Print the end-of-fit summary once, then raise a pending stop error (once)."""
        if not self._finished:
            self._finished = True
            text = format_summary(self.incidents.records, sorted(self.users), self.incidents.path)
            rank_zero_info(text)
            if self.log_dir is not None and trainer.is_global_zero:
                path = os.path.join(self.log_dir, "nanguard", "summary.txt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
        if raise_pending and self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    # ------------------------------------------------------------------ internals
    def _reset_loss(self) -> None:
        self._loss_sum = None
        self._loss_finite = None
        self._last_loss = None

    def _param_index(self, pl_module: pl.LightningModule, optimizer: Optimizer, opt_idx: int) -> ParamIndex:
        index = self._indexes.get(opt_idx)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if (
            index is None
            or len(index.params) != len(params)
            or any(a is not b for a, b in zip(index.params, params, strict=True))
        ):
            names = {id(p): n for n, p in pl_module.named_parameters()}
            depth = max((d for d in self._depths.values()), default=1)
            index = ParamIndex(params, [names.get(id(p), "") for p in params], depth=depth)
            self._indexes[opt_idx] = index
        return index

    def set_layer_depth(self, user: str, depth: int) -> None:
        """The module depth per-layer norms are grouped at (the deepest any installed callback asks for)."""
        self._depths[user] = depth
        self._indexes.clear()


_CONTEXTS: weakref.WeakKeyDictionary[pl.Trainer, NanGuardContext] = weakref.WeakKeyDictionary()


def get_context(trainer: pl.Trainer) -> NanGuardContext:
    """The nanguard context of ``trainer`` (created on first use, dropped with the Trainer)."""
    ctx = _CONTEXTS.get(trainer)
    if ctx is None:
        ctx = _CONTEXTS[trainer] = NanGuardContext()
    return ctx


def _optimizer_index(trainer: pl.Trainer, optimizer: Optimizer) -> int:
    for i, opt in enumerate(trainer.optimizers):
        if opt is optimizer or getattr(opt, "optimizer", None) is optimizer:
            return i
    return 0


def _incident_markdown(incident: Incident) -> str:
    values = ", ".join(f"{k}={v}" for k, v in incident.to_dict()["values"].items())
    return (
        f"**{incident.action}** by {incident.source} at step {incident.step} (epoch {incident.epoch}, "
        f"batch {incident.batch_idx}, ranks {incident.ranks}): {incident.trigger}. {values}. {incident.message}"
    )
