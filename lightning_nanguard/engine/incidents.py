"""The incident path: each event's facts, diagnosis, decision and actions, recorded as one incident.

Runs on every rank with rank-reduced inputs (the events come from reduced readings, or from a step DeepSpeed reduced
itself), and every collective here is made by every rank in the same order, so every rank acts identically and
nothing can hang. The pieces: ``diagnose`` (the cause), ``decide`` (the policy's facts), ``act`` (the capabilities
carry the plan out); here the event is merged, the message written, the stop raised, and the record kept.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import cast

import lightning.pytorch as pl
from torch import Tensor

from lightning_nanguard import _distributed, _notices
from lightning_nanguard.contract import Action, Diagnosis, Plan, Signal, StopReason
from lightning_nanguard.engine.accounting import FitLedger
from lightning_nanguard.engine.act import Outcome, carry_out
from lightning_nanguard.engine.bus import EventBus
from lightning_nanguard.engine.capabilities import DEFAULT_MAX_QUARANTINED_FRACTION
from lightning_nanguard.engine.context import IncidentContext
from lightning_nanguard.engine.decide import count_event, note_plan, remedy_facts
from lightning_nanguard.engine.diagnose import diagnose, trigger_note, write_incident_bundle
from lightning_nanguard.engine.events import AfterStep, EventFacts, PendingEvent
from lightning_nanguard.engine.micro_batches import MicroBatch, locate
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.engine.sink import IncidentSink
from lightning_nanguard.engine.state_check import state_before_update, state_verdict
from lightning_nanguard.exceptions import (
    NanGuardError,
    NonFiniteTrainingError,
    RankDivergenceError,
    RecoveryBudgetExhausted,
)
from lightning_nanguard.policies.diagnosis import divergence_diagnosis
from lightning_nanguard.policies.remedy import plan_after_step, plan_remedy
from lightning_nanguard.policies.withdrawal import Blames
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.reporting import messages
from lightning_nanguard.reporting.incidents import Incident
from lightning_nanguard.signals.model_tensors import nonfinite_names

__all__ = ["STOP_ERRORS", "EventHandled", "IncidentPath", "stop_error"]

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
    Signal.PROBE_ROSE,
    Signal.LOSS_AND_GRAD_NORM_SPIKE,
    Signal.LOSS_SPIKE,
    Signal.GRAD_NORM_SPIKE,
]
# An incident's main action: the most consequential one it took.
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
# The error a stop raises, by why it stopped (``NonFiniteTrainingError`` for any reason not listed).
STOP_ERRORS: dict[StopReason, type[NanGuardError]] = {
    StopReason.ROLLBACK_BUDGET: RecoveryBudgetExhausted,
    StopReason.COLLAPSE_BUDGET: RecoveryBudgetExhausted,
}
# What an event DeepSpeed already ended the run with is recorded as: nothing is decided.
_EXITED = Plan((Action.STOP,), "the run already ended")


def stop_error(why: StopReason, signal: Signal) -> type[NanGuardError]:
    """The error a stop raises: a rank divergence that no budget stopped is a ``RankDivergenceError``."""
    error = STOP_ERRORS.get(why, NonFiniteTrainingError)
    if signal is Signal.RANK_DIVERGENCE and error is NonFiniteTrainingError:
        return RankDivergenceError
    return error


class EventHandled:
    """Emitted on the bus after each engine-decided event (identical on every rank): a step that was not healthy."""

    def __init__(self, step: int, incident: Incident) -> None:
        self.step = step
        self.incident = incident


class IncidentPath:
    """Handles one fit's events, one incident per event."""

    def __init__(self, registry: Registry, ledger: FitLedger, sink: IncidentSink, bus: EventBus) -> None:
        self.registry = registry
        self.ledger = ledger
        self.sink = sink
        self.bus = bus

    @property
    def blames(self) -> Blames:
        """The fit's data hypotheses and their quarantines (kept in the ledger)."""
        return self.ledger.blames

    def handle(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        events: list[PendingEvent],
        batch: object,
        batch_idx: int,
        window: tuple[list[MicroBatch], list[Tensor]] | None = None,
    ) -> None:
        """Handle the batch's events as one event (one incident), the most severe first. ``window``: under gradient
        accumulation, the window's earlier micro-batches and its micro-batch losses (``micro_batches``)."""
        events.sort(key=lambda e: _SEVERITY.index(e.signal) if e.signal in _SEVERITY else len(_SEVERITY))
        event = events[0]
        for other in events[1:]:
            event.readings.extend(r for r in other.readings if r not in event.readings)
        if event.after is not None:
            self._after_step(trainer, event.signal, event.after, batch_idx)
            return
        micro: tuple[MicroBatch, bool] | None = None
        if window is not None and event.readings:  # the micro-batch that made the step non-finite
            micro = locate(window[0], MicroBatch(batch, batch_idx, trainer.current_epoch), window[1])
        self._step_event(trainer, pl_module, event, batch, batch_idx, micro)

    def _step_event(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        event: PendingEvent,
        batch: object,
        batch_idx: int,
        micro: tuple[MicroBatch, bool] | None,
    ) -> None:
        """A training-step event: check the state, diagnose, decide, act, record. ``micro``: under gradient
        accumulation, this rank's micro-batch to blame and whether its window showed one (``micro_batches.locate``):
        each rank diagnoses (and quarantines from) its own, and the record names the one of the first bad rank."""
        registry, ledger = self.registry, self.ledger
        step = event.readings[0].step if event.readings else trainer.global_step
        # The state before the update where the host path took it (the same on every rank: the readings are
        # reduced), else now (the update was dropped on the device, or there was none).
        before = next((r.state_before for r in event.readings if r.state_before is not None), None)
        state_ok, names = before if before is not None else state_before_update(trainer, pl_module)
        samples = None
        if micro is not None:
            batch, samples = micro[0].batch, micro[0].samples
        ranks, batch_idx = _bad_ranks(trainer, event, batch_idx, micro)
        facts = EventFacts(event, step, batch, batch_idx, state_ok, tuple(names), ranks, samples)
        ctx = IncidentContext(trainer, pl_module, facts, registry, ledger, self.bus, self.sink.run_dir)
        if event.signal is Signal.RANK_DIVERGENCE:
            diagnosis = divergence_diagnosis(state_verdict(trainer, pl_module).diverged)
        else:
            diagnosis = diagnose(ctx)
        # Forensics: the incident bundle, before any action changes the weights or the random state.
        bundle = write_incident_bundle(ctx, diagnosis)
        decided = remedy_facts(ctx, diagnosis, count_event(ctx, diagnosis))
        plan = plan_remedy(decided)
        note_plan(decided, plan, ledger, step)
        out = carry_out(ctx, plan, diagnosis)
        trigger_note(out.details, diagnosis)  # forensics: a formula bug's trigger, quarantined, is said to be one
        fraction = (
            registry.guard.max_quarantined_fraction if registry.guard is not None else DEFAULT_MAX_QUARANTINED_FRACTION
        )
        if registry.quarantine is not None:
            _settle_blames(self.blames, registry.quarantine, diagnosis, step, out, fraction)
        restore_failed = Action.ROLLBACK in plan.actions and not out.restored and plan.stop is None
        if restore_failed and (not facts.state_ok or diagnosis.state_damaged):
            plan = Plan(
                (*plan.actions, Action.STOP),
                "the state is non-finite and nothing verified could be restored",
                stop=StopReason.RESTORE_FAILED,
            )
        if out.checkpoint:
            out.values["final_checkpoint"] = out.checkpoint
        where = messages.where_text(step, trainer.current_epoch, batch_idx, facts.ranks)
        collapse = event.collapse
        why = collapse.reason if collapse is not None else ""
        if plan.stop is not None:
            message = messages.stop_message(
                event.signal,
                where,
                diagnosis,
                plan,
                out.details,
                tried=self.tried(),
                state_now=_state_now(trainer, pl_module),
                checkpoint=out.checkpoint,
                why=why,
            )
        else:
            message = messages.incident_message(event.signal, where, diagnosis, plan, out.details, why=why)
        values = {**_values_of(facts.readings), **out.values, **(collapse.values if collapse else {})}
        self._record(
            trainer,
            Incident(
                step=step,
                epoch=int(trainer.current_epoch),
                batch_idx=batch_idx,
                ranks=list(facts.ranks),
                trigger=event.signal,
                action=_primary(plan.actions),
                source=self._sources(plan.actions, plan.stop),
                values=values,
                budget_left=self._budget_left(step),
                message=message,
                actions=list(plan.actions),
                cause=diagnosis.cause,
                where=diagnosis.where,
                diagnosis=diagnosis.to_dict(),
                bundle=bundle,
            ),
            plan,
        )

    def _after_step(self, trainer: pl.Trainer, signal: Signal, after: AfterStep, batch_idx: int) -> None:
        """An event seen after someone else took the step (DeepSpeed): decide, and record; nothing to undo."""
        plan = _EXITED if after.exited else plan_after_step(after.facts)
        message = after.narrate(plan)
        primary = _primary(plan.actions)
        incident = Incident(
            step=after.step,
            epoch=int(trainer.current_epoch),
            batch_idx=batch_idx,
            ranks=list(after.ranks),
            trigger=signal,
            action=primary,
            source=after.sources.get(primary, "nanguard"),
            values=dict(after.values),
            budget_left=after.budget_left,
            message=message,
            actions=list(plan.actions),
            cause=after.cause,
        )
        self._record(trainer, incident, plan, warn=after.exited)

    def _record(self, trainer: pl.Trainer, incident: Incident, plan: Plan, *, warn: bool = False) -> None:
        """Warn where the plan lets training go on, stop where it ends it, keep the record, tell the subscribers."""
        if plan.stop is not None:
            self.ledger.request_stop(trainer, stop_error(plan.stop, cast(Signal, incident.trigger))(incident.message))
        repeat = self.sink.record(trainer, incident)
        if (warn or Action.WARN in plan.actions) and not repeat:  # a recurring incident warns the first time
            _notices.warn(incident.message)
        self.bus.emit(trainer, EventHandled(incident.step, incident))

    def report(self, trainer: pl.Trainer, incident: Incident) -> bool:
        """Keep the record of what was decided where it was seen, outside a training step's event (a preflight
        finding, a checkpoint refused, a headroom promotion, an evaluation re-run, the end-of-fit restore): the one
        way into the sink beside ``handle``'s. No ``EventHandled``: no remedy's bookkeeping follows it. Rank-local
        ones (a checkpoint refused on rank 0) never feed a decision. True for a repeat of an earlier record."""
        return self.sink.record(trainer, incident)

    def tried(self) -> str:
        """What the run has tried so far, from the records' actions."""
        counts: Counter[str] = Counter()
        for r in self.sink.records:
            counts.update({str(a): r.count for a in r.actions})
        scale = getattr(self.registry.backoff, "lr_scale", None)
        return messages.tried_phrase(counts, float(scale) if isinstance(scale, (int, float)) else None)

    def _sources(self, actions: tuple[Action, ...], stop: StopReason | None = None) -> str:
        """Whose remedies acted, each once, in the order of the actions (a stop: the callback whose rule or budget
        ended training; ``"nanguard"`` only where no callback's remedy acted)."""
        r = self.registry
        guard = r.guard.owner if r.guard is not None else ""
        restorer = getattr(r.restorer, "owner", "")
        stopper = (
            {
                StopReason.ROLLBACK_BUDGET: restorer,
                StopReason.NOTHING_VERIFIED: restorer,
                StopReason.RESTORE_FAILED: restorer,
                StopReason.COLLAPSE_BUDGET: getattr(r.scale_watch, "owner", ""),
                StopReason.STOP_ON_COLLAPSE: getattr(r.scale_watch, "owner", ""),
                StopReason.COLLAPSE_UNRESTORABLE: getattr(r.scale_watch, "owner", ""),
            }.get(stop, guard)
            if stop is not None
            else ""
        )
        owners: Mapping[Action, str] = {
            Action.SKIP: guard or getattr(r.restorer, "owner", ""),
            Action.SCALER_SKIP: "GradScaler",
            Action.QUARANTINE: guard,
            Action.ROLLBACK: getattr(r.restorer, "owner", ""),
            Action.BACKOFF: getattr(r.backoff, "owner", ""),
            Action.EPS_BACKOFF: getattr(r.backoff, "owner", ""),
            Action.PROMOTE: getattr(r.promoter, "owner", ""),
            Action.WARN: guard or "nanguard",
            Action.STOP: stopper or guard or restorer,
        }
        found: list[str] = []
        for a in actions:
            owner = owners.get(a, "")
            if owner and owner not in found:
                found.append(owner)
        return ", ".join(found) or "nanguard"

    def _budget_left(self, step: int) -> int:
        r = self.registry
        if r.restorer is not None:
            return r.restorer.budget_left(step)
        if r.guard is not None:
            return max(0, r.guard.max_consecutive_skips - self.ledger.skip_streak)
        return -1


def _settle_blames(
    blames: Blames, quarantine: Quarantine, d: Diagnosis, step: int, out: Outcome, fraction: float
) -> None:
    """After the actions: release what a withdrawn chain held; add this incident's quarantine to its chain, and
    withdraw (and release) the chain whose records pass the quarantined-share budget (``policies.withdrawal``)."""
    for due in blames.releases_due():
        quarantine.release(due.samples, due.prints, step)
    added = out.quarantined
    if Action.QUARANTINE not in out.details or added is None:
        return
    chain = blames.add(d, step, added.samples, added.prints)
    size = quarantine.dataset_size() or 0
    held = blames.past_share(size, fraction) if chain is not None else None
    if chain is None or held is None:
        return
    released = quarantine.release(chain.samples, chain.prints, step)
    line = blames.withdraw(chain, d, step, held, size, fraction, released)
    out.details[Action.QUARANTINE] += f"; then {line.split(': ', 1)[1]}"


def _bad_ranks(
    trainer: pl.Trainer, event: PendingEvent, batch_idx: int, micro: tuple[MicroBatch, bool] | None
) -> tuple[tuple[int, ...], int]:
    """The ranks whose own reading (for a state check: own state) was non-finite (an all-gather; every rank is here),
    and the batch the record names: under gradient accumulation the micro-batch the first of them found (the same on
    every rank)."""
    found = micro[0].batch_idx if micro is not None and micro[1] else -1
    if trainer.world_size <= 1:
        return (0,), found if found >= 0 else batch_idx
    local = [
        (r.inline or 1, r.local.detach().float().cpu().tolist()) for r in event.readings if r.local is not None
    ]  # (where the loss is, this rank's own vector): the fast path puts the per-tensor norms first
    # This rank's own loss (never reduced) names the rank best: gradients are all-reduced in the backward, so every
    # rank sees another rank's NaN gradient; a gradient that went bad after the reduction is this rank's own.
    loss_bad = any(len(vec) > at and not math.isfinite(vec[at]) for at, vec in local)
    any_bad = any(not all(math.isfinite(v) for v in vec) for _, vec in local)
    if not event.readings and event.signal is Signal.NONFINITE_STATE:
        # A state check (no step reading): the ranks whose own parameters or buffers are non-finite.
        any_bad = bool(nonfinite_names(trainer.lightning_module, limit=1))
    gathered = _distributed.all_gather_objects(trainer, (loss_bad, any_bad, found))
    ranks = [i for i, g in enumerate(gathered) if g[0]] or [i for i, g in enumerate(gathered) if g[1]]
    ranks = ranks or list(range(trainer.world_size))
    named = next((gathered[r][2] for r in ranks if gathered[r][2] >= 0), -1)
    named = named if named >= 0 else next((g[2] for g in gathered if g[2] >= 0), batch_idx)
    return tuple(ranks), named


def _values_of(readings: list[Reading]) -> dict[str, object]:
    """The first reading behind an event as plain floats (grad norm, loss, loss scale, a spike's z-scores)."""
    out: dict[str, object] = {}
    for r in readings[:1]:
        if r.has_grads:
            out["grad_norm"] = r.grad_norm
        if r.loss is not None:
            out["loss"] = r.loss
        if r.scale is not None:
            out["loss_scale"] = r.scale
        out.update(r.zscores or {})
    return out


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


def _primary(actions: tuple[Action, ...]) -> Action:
    for a in _PRIMARY:
        if a in actions:
            return a
    return Action.NONE
