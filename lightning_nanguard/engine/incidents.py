"""The incident path: for each event, check the state, diagnose, decide, act, and record one incident.

Runs on every rank with rank-reduced inputs (the events come from reduced readings), and every collective here is
made by every rank in the same order, so every rank acts identically and nothing can hang.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lightning_nanguard import _distributed
from lightning_nanguard.contract import (
    Action,
    Cause,
    Diagnosis,
    Evidence,
    EvidenceKind,
    Plan,
    RestoreSource,
    Signal,
    StateRestored,
    StopReason,
)
from lightning_nanguard.engine.capabilities import DEFAULT_MAX_CONSECUTIVE_SKIPS, Restored
from lightning_nanguard.engine.diagnose import EventFacts, diagnose
from lightning_nanguard.engine.state_check import model_finite, state_before_update, state_verdict
from lightning_nanguard.exceptions import (
    NanGuardError,
    NonFiniteTrainingError,
    RankDivergenceError,
    RecoveryBudgetExhausted,
)
from lightning_nanguard.policies.causes import CAUSES
from lightning_nanguard.policies.remedy import Installed, RemedyFacts, plan_remedy
from lightning_nanguard.reporting import messages
from lightning_nanguard.reporting.incidents import Incident
from lightning_nanguard.signals.model_tensors import nonfinite_names

if TYPE_CHECKING:
    from lightning_nanguard.engine.engine import Engine, PendingEvent

__all__ = ["EventHandled", "final_check", "handle"]

# Most severe first: when several events happen in one batch (manual optimization), one incident carries them.
_SEVERITY = [
    Signal.LOSS_SCALE_COLLAPSE,
    Signal.NONFINITE_STATE,
    Signal.RANK_DIVERGENCE,
    Signal.NONFINITE_LOSS_AND_GRADS,
    Signal.NONFINITE_LOSS,
    Signal.NONFINITE_GRADS,
    Signal.NONFINITE_ON_OTHER_RANK,
    Signal.DIVERGING,
    Signal.LOSS_AND_GRAD_NORM_SPIKE,
    Signal.LOSS_SPIKE,
    Signal.GRAD_NORM_SPIKE,
]
_SPIKES = (Signal.LOSS_SPIKE, Signal.GRAD_NORM_SPIKE, Signal.LOSS_AND_GRAD_NORM_SPIKE)
_PRIMARY = [
    Action.STOP,
    Action.ROLLBACK,
    Action.PROMOTE,
    Action.BACKOFF,
    Action.EPS_BACKOFF,
    Action.QUARANTINE,
    Action.SKIP,
    Action.SCALER_SKIP,
    Action.WARN,
]


class EventHandled:
    """Emitted on the bus after each engine-decided event (identical on every rank): a step that was not healthy."""

    def __init__(self, step: int, incident: Incident) -> None:
        self.step = step
        self.incident = incident


def handle(engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, events: list[PendingEvent]) -> None:
    """Handle the batch's events as one event (one incident)."""
    events.sort(key=lambda e: _SEVERITY.index(e.signal) if e.signal in _SEVERITY else len(_SEVERITY))
    event = events[0]
    for other in events[1:]:
        event.readings.extend(r for r in other.readings if r not in event.readings)
    _handle_one(engine, trainer, pl_module, event)


def _handle_one(engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, event: PendingEvent) -> None:
    step = event.readings[0].step if event.readings else trainer.global_step
    # The state before the update where the host path took it (the same on every rank: the readings are reduced),
    # else now (the update was dropped on the device, or there was none).
    before = next((r.state_before for r in event.readings if r.state_before is not None), None)
    state_ok, names = before if before is not None else state_before_update(trainer, pl_module)
    facts = EventFacts(event, state_ok=state_ok, state_names=names, ranks=_bad_ranks(trainer, event))
    if event.signal is Signal.RANK_DIVERGENCE:
        diagnosis = divergence_diagnosis(state_verdict(trainer, pl_module).diverged)
    else:
        diagnosis = diagnose(engine, trainer, pl_module, facts)
    plan = plan_remedy(_remedy_facts(engine, trainer, facts, diagnosis))
    details, values, checkpoint = _act(engine, trainer, pl_module, plan, diagnosis, step, facts.signal)
    failed = Action.ROLLBACK in plan.actions and "restored_from_step" not in values and not plan.stop
    if failed and (not facts.state_ok or diagnosis.state_damaged):
        plan = Plan(
            (*plan.actions, Action.STOP),
            "the state is non-finite and nothing verified could be restored",
            stop=StopReason.RESTORE_FAILED,
        )
    if checkpoint:
        values["final_checkpoint"] = checkpoint
    where = messages.where_text(step, trainer.current_epoch, engine.batch_idx, facts.ranks)
    why = facts.event.collapse.reason if facts.event.collapse is not None else ""
    if plan.stop is not None:
        state_now = _state_now(trainer, pl_module)
        message = messages.stop_message(
            facts.signal,
            where,
            diagnosis,
            plan,
            details,
            tried=_tried(engine),
            state_now=state_now,
            checkpoint=checkpoint,
            why=why,
        )
        engine.request_stop(trainer, stop_error(plan.stop, facts.signal)(message))
    else:
        message = messages.incident_message(facts.signal, where, diagnosis, plan, details, why=why)
    if Action.WARN in plan.actions:
        rank_zero_warn(message)
    incident = Incident(
        step=step,
        epoch=int(trainer.current_epoch),
        batch_idx=engine.batch_idx,
        ranks=list(facts.ranks),
        trigger=facts.signal.value,
        action=_primary(plan.actions).value,
        source=_sources(engine, plan.actions),
        values={
            **messages.values_of(facts.readings),
            **values,
            **(facts.event.collapse.values if facts.event.collapse else {}),
        },
        budget_left=_budget_left(engine, step),
        message=message,
        actions=[a.value for a in plan.actions],
        cause=diagnosis.cause.value,
        where=diagnosis.where,
        diagnosis=diagnosis.to_dict(),
    )
    engine.sink.record(trainer, incident)
    engine.bus.emit(trainer, EventHandled(step, incident))


def _act(
    engine: Engine,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    plan: Plan,
    diagnosis: Diagnosis,
    step: int,
    signal: Signal,
) -> tuple[dict[Action, str], dict[str, Any], str]:
    """Carry out the plan. Every rank runs the same actions (the plan came from rank-consistent facts)."""
    details: dict[Action, str] = {}
    values: dict[str, Any] = {}
    checkpoint = ""
    acts = set(plan.actions)
    if Action.WARN in acts and signal is Signal.LOSS_SCALE_COLLAPSE and engine.scale_watch is not None:
        left = engine.scale_watch.collapses_left()
        budget = "" if left is None else f"; {left} more collapses allowed"
        details[Action.WARN] = f"kept training (on_collapse={engine.scale_watch.on_collapse!r}{budget})"
    elif Action.WARN in acts and engine.guard is not None:
        setting = "on_spike" if signal in _SPIKES else "on_nonfinite"
        value = engine.guard.on_spike if setting == "on_spike" else engine.guard.on_nonfinite
        details[Action.WARN] = f"let the update through ({setting}={value!r})"
    if Action.QUARANTINE in acts and engine.quarantine is not None:
        rank = trainer.global_rank
        rows, take = diagnosis.rows, not diagnosis.ranks or rank in diagnosis.ranks
        if diagnosis.rank_rows and rank < len(diagnosis.rank_rows):
            rows = diagnosis.rank_rows[rank]  # this rank's own rows: row 3 of another rank is another sample
            take = bool(rows)
        details[Action.QUARANTINE] = engine.quarantine.add(trainer, engine.batch, rows, step, take=take)
    if Action.ROLLBACK in acts and engine.restorer is not None:
        restored = engine.restorer.restore(trainer, pl_module, step)
        if restored is None:
            details[Action.ROLLBACK] = "found nothing verified to roll back to"
        else:
            details[Action.ROLLBACK] = _restored_text(restored)
            values.update(
                restored_from_step=restored.step,
                rollback_source=restored.source,
                steps_lost=step - restored.step,
                recurrence=restored.recurrence,
            )
            if restored.path:
                values["checkpoint"] = restored.path
            engine.skip_streak = 0
            engine.bus.emit(trainer, StateRestored(restored.step, RestoreSource(restored.source)))
    if (Action.BACKOFF in acts or Action.EPS_BACKOFF in acts) and engine.backoff is not None:
        lr = Action.BACKOFF in acts
        eps = Action.EPS_BACKOFF in acts or (lr and engine.backoff.eps_applies(trainer))
        changed = engine.backoff.back_off(trainer, lr=lr, eps=eps, cause=diagnosis.cause.value)
        engine.recent_skips.clear()  # the skips behind this backoff are answered: count afresh
        values.update(changed)
        if lr:
            details[Action.BACKOFF] = str(changed.get("lr_text", "lowered the learning rate"))
        if eps and "eps_text" in changed:
            details[Action.EPS_BACKOFF] = str(changed["eps_text"])
    if Action.PROMOTE in acts and engine.promoter is not None and plan.promote_module:
        details[Action.PROMOTE] = engine.promoter.promote(trainer, pl_module, plan.promote_module)
    if acts & {Action.PROMOTE, Action.ROLLBACK, Action.EPS_BACKOFF}:
        engine.replays.forget()  # the model or optimizer changed
    if plan.stop and Action.ROLLBACK in acts and engine.restorer is not None:
        save = getattr(engine.restorer, "save_final", None)
        if callable(save):
            checkpoint = str(save(trainer, step) or "")
    return details, values, checkpoint


def _remedy_facts(engine: Engine, trainer: pl.Trainer, facts: EventFacts, diagnosis: Diagnosis) -> RemedyFacts:
    guard, restorer, backoff = engine.guard, engine.restorer, engine.backoff
    step = facts.readings[0].step if facts.readings else trainer.global_step
    scaler_dropped = any(r.dropped and r.scale is not None and r.bad for r in facts.readings)
    # Under 16-mixed with a LossScaleWatchdog, a run of overflows is the watchdog's (its collapse rule); otherwise
    # GradNormMonitor's max_consecutive_skips counts every dropped step.
    routine = facts.scaler_overflow and facts.state_ok and engine.scale_watch is not None
    if routine:
        max_skips = None
    elif guard is not None:
        max_skips = guard.max_consecutive_skips
    else:  # AutoRollback alone still escalates a run of dropped updates (GradNormMonitor's default budget)
        max_skips = DEFAULT_MAX_CONSECUTIVE_SKIPS if restorer is not None else None
    recent = 0
    cause = CAUSES[diagnosis.cause]
    # Skips that count toward a backoff (``CauseSpec.counts_toward_backoff``), with the state intact (a rollback is a
    # damaged state's remedy); not the GradScaler's routine skips (a run of them is LossScaleWatchdog's collapse).
    if (
        backoff is not None
        and cause.counts_toward_backoff
        and not (scaler_dropped and cause.routine_under_scaler)
        and facts.state_ok
        and facts.signal is not Signal.NONFINITE_STATE
    ):
        engine.recent_skips.append(step)
        recent = sum(1 for s in engine.recent_skips if step - s < backoff.skip_window)
    module = diagnosis.module
    if module and cause.counts_module_overflow:
        engine.module_overflows[module] = engine.module_overflows.get(module, 0) + 1
    installed = Installed(
        drop=engine.restorer is not None or (guard is not None and guard.on_nonfinite != "warn"),
        quarantine=engine.quarantine is not None,
        rollback=restorer is not None,
        backoff=backoff is not None,
        eps_backoff=backoff is not None and backoff.eps_applies(trainer),
        promote=engine.promoter is not None,
    )
    watch = engine.scale_watch
    collapse = facts.event.collapse
    return RemedyFacts(
        signal=facts.signal,
        cause=diagnosis.cause,
        installed=installed,
        state_damaged=not facts.state_ok,
        caused_by_data=diagnosis.caused_by_data,
        has_update=bool(facts.readings),
        scaler_dropped=scaler_dropped,
        on_nonfinite=guard.on_nonfinite if guard is not None else "skip",
        on_spike=guard.on_spike if guard is not None else "warn",
        on_collapse=watch.on_collapse if watch is not None else "auto",
        skip_streak=engine.skip_streak,
        max_consecutive_skips=max_skips,
        backoff_triggers=backoff.triggers if backoff is not None else frozenset(),
        recent_skips=recent,
        skips_before_backoff=backoff.skips_before_backoff if backoff is not None else 3,
        module=module,
        module_overflows=engine.module_overflows.get(module, 0),
        promote_after=(
            engine.promoter.promote_after
            if engine.promoter is not None and module not in engine.promoter.promoted
            else None
        ),
        true_half=_lightning_true_half(trainer),
        can_restore=restorer is not None and restorer.can_restore(trainer, step),
        rollback_budget_left=restorer.budget_left(step) if restorer is not None else 1,
        collapse_budget_left=collapse.budget_left if collapse is not None else 1,
    )


def final_check(engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """End of fit: a fit that returns normally has finite parameters and buffers, identical on every rank (DDP);
    otherwise restore or raise."""
    verdict = state_verdict(trainer, pl_module)
    if verdict.sound:
        engine.final_state = "finite (checked at the end of fit)"
        return
    if verdict.finite:
        _final_divergence(engine, trainer, pl_module, verdict.diverged)
        return
    gathered = _distributed.all_gather_objects(trainer, nonfinite_names(pl_module))
    names = sorted({n for part in gathered for n in part})  # type: ignore[attr-defined]
    restorer = engine.restorer
    diagnosis = Diagnosis(
        Cause.CORRUPT_STATE, where=", ".join(names[:3]), state_tensors=tuple(names), state_damaged=True
    )
    restored = _restore_at_end(
        engine,
        trainer,
        pl_module,
        Signal.NONFINITE_STATE,
        diagnosis,
        problem=f"non-finite parameters or buffers at the end of fit ({', '.join(names[:5])})",
        promise="the model fit() returns is finite",
    )
    if restored is not None:
        engine.final_state = (
            f"finite: restored from step {restored.step} ({restored.source}) at the end of fit, because the "
            f"last update(s) left {', '.join(names[:3])} non-finite"
        )
        return
    engine.final_state = f"NON-FINITE ({', '.join(names[:3])})"
    hint = "" if restorer is not None else "add AutoRollback() so the last verified state is restored"
    if restorer is not None:
        hint = "AutoRollback had no verified snapshot or checkpoint to restore: snapshot more often (every_n_steps)"
    error = NonFiniteTrainingError(messages.final_state_error(names, _tried(engine), hint))
    if engine.pending_error is None:
        engine.pending_error = error


def _restore_at_end(
    engine: Engine,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    signal: Signal,
    diagnosis: Diagnosis,
    *,
    problem: str,
    promise: str,
) -> Restored | None:
    """End of fit: restore the newest verified state and record the incident (``problem``: what was found;
    ``promise``: what the restore guarantees). ``None`` when nothing verified could be restored."""
    restorer = engine.restorer
    if restorer is None or not restorer.can_restore(trainer, trainer.global_step):
        return None
    restored = restorer.restore(trainer, pl_module, trainer.global_step)
    if restored is None or not model_finite(trainer, pl_module):
        return None
    incident = Incident(
        step=trainer.global_step,
        epoch=int(trainer.current_epoch),
        batch_idx=-1,
        ranks=list(range(trainer.world_size)),
        trigger=signal.value,
        action=Action.ROLLBACK.value,
        source=restorer.owner,
        values={"restored_from_step": restored.step, "rollback_source": restored.source},
        message=f"{problem}: {_restored_text(restored)}, so {promise}. The last updates were lost.",
        actions=[Action.ROLLBACK.value],
        cause=Cause.CORRUPT_STATE.value,
        where=diagnosis.where,
        diagnosis=diagnosis.to_dict(),
    )
    engine.sink.record(trainer, incident)
    engine.bus.emit(trainer, StateRestored(restored.step, RestoreSource(restored.source)))
    return restored


def divergence_diagnosis(names: tuple[str, ...]) -> Diagnosis:
    """The diagnosis of a rank divergence: the state is damaged (the ranks no longer train one model)."""
    listed = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
    return Diagnosis(
        Cause.CORRUPT_STATE,
        where=f"{', '.join(names[:3])}: the ranks' copies differ",
        evidence=(Evidence(EvidenceKind.RANKS_DIVERGED, f"differ across ranks: {listed}", {"tensors": names}),),
        hint=(
            "something changed one rank's copy only (a rank-local write, a fault after the gradient all-reduce); "
            "DDP never re-broadcasts parameters, so the ranks would train different models from here on"
        ),
        state_tensors=names,
        state_damaged=True,
    )


def _final_divergence(
    engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, names: tuple[str, ...]
) -> None:
    """End of fit under DDP with finite parameters whose copies differ: restore an agreed state, or raise."""
    restorer = engine.restorer
    restored = _restore_at_end(
        engine,
        trainer,
        pl_module,
        Signal.RANK_DIVERGENCE,
        divergence_diagnosis(names),
        problem=f"the ranks' parameters differ at the end of fit ({', '.join(names[:5])})",
        promise="every rank returns the same model",
    )
    if restored is not None:
        engine.final_state = (
            f"finite and identical on every rank: restored from step {restored.step} ({restored.source}) at the "
            f"end of fit, because the ranks' copies of {', '.join(names[:3])} differed"
        )
        return
    engine.final_state = f"finite, but the ranks' copies of {', '.join(names[:3])} DIFFER"
    hint = (
        "AutoRollback had no verified snapshot or checkpoint to restore: snapshot more often (every_n_steps)"
        if restorer is not None
        else "add AutoRollback() so the last state verified identical on every rank is restored"
    )
    error = RankDivergenceError(messages.divergence_error(names, _tried(engine), hint))
    if engine.pending_error is None:
        engine.pending_error = error


def _bad_ranks(trainer: pl.Trainer, event: PendingEvent) -> list[int]:
    """The ranks whose own reading was non-finite (an all-gather; every rank is here)."""
    if trainer.world_size <= 1:
        return [0]
    import math

    local = [
        (r.inline or 1, r.local.detach().float().cpu().tolist()) for r in event.readings if r.local is not None
    ]  # (where the loss is, this rank's own vector): the fast path puts the per-tensor norms first
    # This rank's own loss (never reduced) names the rank best: gradients are all-reduced in the backward, so every
    # rank sees another rank's NaN gradient; a gradient that went bad after the reduction is this rank's own.
    loss_bad = any(len(vec) > at and not math.isfinite(vec[at]) for at, vec in local)
    any_bad = any(not all(math.isfinite(v) for v in vec) for _, vec in local)
    gathered = [cast(tuple[bool, bool], g) for g in _distributed.all_gather_objects(trainer, (loss_bad, any_bad))]
    ranks = [i for i, g in enumerate(gathered) if g[0]] or [i for i, g in enumerate(gathered) if g[1]]
    return ranks or list(range(trainer.world_size))


def _restored_text(restored: Restored) -> str:
    where = f" from {restored.path}" if restored.path else ""
    again = ", an older state: the last restore led straight back into trouble" if restored.recurrence else ""
    return f"rolled back to step {restored.step} ({restored.source}{where}{again})"


def _state_now(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
    verdict = state_verdict(trainer, pl_module)
    if not verdict.finite:
        return "parameters or buffers are NON-FINITE: do not save or export this model"
    if verdict.diverged:
        return (
            f"finite, but the ranks' copies of {', '.join(verdict.diverged[:3])} DIFFER: rank 0's model is not what "
            "the other ranks trained"
        )
    return "parameters and buffers are finite (checked)"


def _tried(engine: Engine) -> str:
    counts: Counter[str] = Counter(a for r in engine.sink.records for a in r.actions)
    scale = getattr(engine.backoff, "lr_scale", None)
    return messages.tried_phrase(counts, float(scale) if isinstance(scale, (int, float)) else None)


def _primary(actions: tuple[Action, ...]) -> Action:
    for a in _PRIMARY:
        if a in actions:
            return a
    return Action.NONE


def _sources(engine: Engine, actions: tuple[Action, ...]) -> str:
    owners: list[str] = []
    for a in actions:
        owner = {
            Action.SKIP: engine.guard.owner if engine.guard is not None else getattr(engine.restorer, "owner", ""),
            Action.SCALER_SKIP: "GradScaler",
            Action.QUARANTINE: engine.guard.owner if engine.guard is not None else "",
            Action.ROLLBACK: getattr(engine.restorer, "owner", ""),
            Action.BACKOFF: getattr(engine.backoff, "owner", ""),
            Action.EPS_BACKOFF: getattr(engine.backoff, "owner", ""),
            Action.PROMOTE: getattr(engine.promoter, "owner", ""),
            Action.WARN: engine.guard.owner if engine.guard is not None else "nanguard",
            Action.STOP: "nanguard",
        }.get(a, "")
        if owner and owner not in owners:
            owners.append(owner)
    return ", ".join(owners) or "nanguard"


def _budget_left(engine: Engine, step: int) -> int:
    if engine.restorer is not None:
        return engine.restorer.budget_left(step)
    if engine.guard is not None:
        return max(0, engine.guard.max_consecutive_skips - engine.skip_streak)
    return -1


# The error a stop raises, by why it stopped (``NonFiniteTrainingError`` for any reason not listed).
STOP_ERRORS: dict[StopReason, type[NanGuardError]] = {
    StopReason.ROLLBACK_BUDGET: RecoveryBudgetExhausted,
    StopReason.COLLAPSE_BUDGET: RecoveryBudgetExhausted,
}


def stop_error(why: StopReason, signal: Signal) -> type[NanGuardError]:
    """The error to raise: a rank divergence that no budget stopped is a ``RankDivergenceError``."""
    error = STOP_ERRORS.get(why, NonFiniteTrainingError)
    if signal is Signal.RANK_DIVERGENCE and error is NonFiniteTrainingError:
        return RankDivergenceError
    return error


def _lightning_true_half(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.plugins.precision import HalfPrecision

    return isinstance(trainer.precision_plugin, HalfPrecision)
