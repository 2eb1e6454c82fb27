"""Act: carry out a plan with the installed capabilities. Every rank runs the same actions (the plan came from
rank-consistent facts), and what each action did comes back as a sentence and the values for the record."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nanguard.contract import SPIKES, Action, Diagnosis, Plan, RestoreSource, Signal, StateRestored
from lightning_nanguard.engine.capabilities import Restored
from lightning_nanguard.engine.context import IncidentContext
from lightning_nanguard.engine.decide import repairable_buffers
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.recovery.quarantine import Added

__all__ = ["Outcome", "carry_out", "restored_text"]


@dataclass
class Outcome:
    """What the actions did: a sentence per action, the values for the incident record, the final checkpoint."""

    details: dict[Action, str] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)
    restored: bool = False
    checkpoint: str = ""  # a verified checkpoint saved before a stop
    quarantined: Added | None = None  # what the quarantine added


def carry_out(ctx: IncidentContext, plan: Plan, diagnosis: Diagnosis) -> Outcome:
    """Carry ``plan`` out with the capabilities; what each action did."""
    trainer, pl_module, facts, registry, ledger = ctx.trainer, ctx.pl_module, ctx.facts, ctx.registry, ctx.ledger
    bus = ctx.bus
    out = Outcome()
    acts = set(plan.actions)
    if Action.WARN in acts:
        if acts & {Action.SKIP, Action.SCALER_SKIP} and facts.signal is not Signal.LOSS_SCALE_COLLAPSE:
            # A warning beside a drop is the dropped-updates budget's (``policies.remedy``): the run goes on.
            out.details[Action.WARN] = "kept training past the dropped-updates budget (on_dropped_budget='warn')"
        else:
            _warned(out, facts.signal, registry)
    if Action.QUARANTINE in acts and registry.quarantine is not None:
        rank = trainer.global_rank
        rows, take = diagnosis.rows, not diagnosis.ranks or rank in diagnosis.ranks
        if diagnosis.rank_rows and rank < len(diagnosis.rank_rows):
            rows = diagnosis.rank_rows[rank]  # this rank's own rows: row 3 of another rank is another sample
            take = bool(rows)
        added = registry.quarantine.add(trainer, facts.batch, rows, facts.step, take=take, samples=facts.samples)
        out.details[Action.QUARANTINE], out.quarantined = added.message, added
    restorer = registry.restorer
    if Action.ROLLBACK in acts and restorer is not None:
        repair = repairable_buffers(diagnosis, pl_module)
        repaired = restorer.repair_buffers(trainer, pl_module, repair) if repair else None
        restored = repaired or restorer.restore(trainer, pl_module, facts.step)
        if restored is None:
            out.details[Action.ROLLBACK] = "found nothing verified to roll back to"
        else:
            out.restored = True
            out.details[Action.ROLLBACK] = restored_text(restored)
            out.values.update(
                restored_from_step=restored.step,
                rollback_source=restored.source,
                steps_lost=0 if repaired else facts.step - restored.step,
                recurrence=restored.recurrence,
            )
            if restored.path:
                out.values["checkpoint"] = restored.path
            if repaired:  # the buffers alone: nothing else was restored, nothing to re-apply
                out.values["repaired"] = list(restored.repaired)
            else:
                ledger.skip_streak = 0
                bus.emit(trainer, StateRestored(restored.step, RestoreSource(restored.source)))
    backoff = registry.backoff
    if (Action.BACKOFF in acts or Action.EPS_BACKOFF in acts) and backoff is not None:
        lr = Action.BACKOFF in acts
        eps = Action.EPS_BACKOFF in acts or (lr and backoff.eps_applies(trainer))
        result = backoff.back_off(trainer, lr=lr, eps=eps, cause=diagnosis.cause.value)
        ledger.recent_skips.clear()  # the skips behind this backoff are answered: count afresh
        out.values.update(result.values)
        if lr:
            out.details[Action.BACKOFF] = result.lr or "lowered the learning rate"
        if eps and result.eps:
            out.details[Action.EPS_BACKOFF] = result.eps
    if Action.PROMOTE in acts and registry.promoter is not None and plan.promote_module:
        out.details[Action.PROMOTE] = registry.promoter.promote(trainer, pl_module, plan.promote_module)
    if acts & {Action.PROMOTE, Action.ROLLBACK, Action.EPS_BACKOFF}:
        ledger.replays.forget()  # the model or the optimizer changed
    if plan.stop is not None and Action.ROLLBACK in acts and restorer is not None:
        out.checkpoint = restorer.save_final(trainer, facts.step) or ""
    return out


def _warned(out: Outcome, signal: Signal, registry: Registry) -> None:
    """What letting the update through meant, by the setting that chose it."""
    watch, guard = registry.scale_watch, registry.guard
    if signal is Signal.LOSS_SCALE_COLLAPSE and watch is not None:
        left = watch.collapses_left()
        budget = "" if left is None else f"; {left} more collapses allowed"
        out.details[Action.WARN] = f"kept training (on_collapse={watch.on_collapse!r}{budget})"
    elif guard is not None:
        setting = "on_spike" if signal in SPIKES else "on_nonfinite"
        value = guard.on_spike if setting == "on_spike" else guard.on_nonfinite
        out.details[Action.WARN] = f"let the update through ({setting}={value!r})"


def restored_text(restored: Restored) -> str:
    if restored.repaired:
        names = ", ".join(restored.repaired[:3]) + (" ..." if len(restored.repaired) > 3 else "")
        return (
            f"restored the buffers {names} from the snapshot of step {restored.step} (the parameters and optimizer "
            "state are sound: kept, no step lost)"
        )
    where = f" from {restored.path}" if restored.path else ""
    again = ", an older state: the last restore led straight back into trouble" if restored.recurrence else ""
    return f"rolled back to step {restored.step} ({restored.source}{where}{again})"
