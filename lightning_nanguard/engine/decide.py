"""Decide: the facts the remedy policy decides one event from, gathered from what is installed and recorded.

Counting happens here too, once per event and before the facts are read (``count_event``), each as the cause
declares (``policies.causes``): a dropped update of a cause a lower learning rate answers counts toward
OptimizerBackoff's skip rule; a data cause's drop is taken back out of the streak of dropped updates (the quarantine
answers it); a half-precision overflow counts for the module the diagnosis named; the dropped-updates window moves
on; and, once the plan is made (``note_plan``), a drop no rollback answers counts toward the dropped-updates budget.
``remedy_facts`` only reads.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import HalfPrecision

from lightning_nanguard.contract import Diagnosis, Plan, Signal
from lightning_nanguard.engine.accounting import FitLedger
from lightning_nanguard.engine.capabilities import (
    DEFAULT_DROPPED_WINDOW,
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    DEFAULT_MAX_DROPPED_FRACTION,
)
from lightning_nanguard.engine.context import IncidentContext
from lightning_nanguard.engine.events import EventFacts
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.policies.causes import CAUSES
from lightning_nanguard.policies.remedy import RemedyFacts, counts_as_dropped

__all__ = ["count_event", "note_plan", "remedy_facts", "repairable_buffers"]


def _scaler_dropped(facts: EventFacts) -> bool:
    return any(r.dropped and r.scale is not None and r.bad for r in facts.readings)


def _dropped_window(registry: Registry) -> tuple[float | None, int, str]:
    """The dropped-updates budget: the fraction, the window and what its end does."""
    guard = registry.guard
    if guard is not None:
        return guard.max_dropped_fraction, guard.dropped_window, guard.on_dropped_budget
    # AutoRollback alone drops non-finite updates too: GradNormMonitor's default budget bounds them
    return (DEFAULT_MAX_DROPPED_FRACTION if registry.restorer is not None else None), DEFAULT_DROPPED_WINDOW, "stop"


def count_event(ctx: IncidentContext, diagnosis: Diagnosis) -> int:
    """Count the event into the ledger as its cause declares (module docstring); the drops of the skip rule's window
    (0 where this event's drop does not count toward a backoff)."""
    facts, registry, ledger = ctx.facts, ctx.registry, ctx.ledger
    step, backoff = facts.step, registry.backoff
    cause = CAUSES[diagnosis.cause]
    if cause.data_at_fault and facts.readings and ledger.skip_streak > 0:
        ledger.skip_streak -= 1  # the quarantine answers bad data: its drop is no step of a streak
    recent = 0
    # Skips that count toward a backoff: of a cause a lower learning rate answers (``Remedy.lowers_lr``), with the
    # state intact (a rollback is a damaged state's remedy); not the GradScaler's routine skips (a run of them is
    # LossScaleWatchdog's collapse).
    if (
        backoff is not None
        and cause.remedy.lowers_lr
        and not (_scaler_dropped(facts) and cause.routine_under_scaler)
        and any(r.dropped for r in facts.readings)
        and facts.state_ok
        and facts.signal is not Signal.NONFINITE_STATE
    ):
        ledger.recent_skips.append(step)
        recent = sum(1 for s in ledger.recent_skips if step - s < backoff.skip_window)
    module = diagnosis.module
    if module and cause.counts_module_overflow:
        ledger.module_overflows[module] = ledger.module_overflows.get(module, 0) + 1
    _, window, _ = _dropped_window(registry)
    dropped = ledger.dropped_steps
    while dropped and step - dropped[0] >= window:
        dropped.popleft()
    return recent


def remedy_facts(ctx: IncidentContext, diagnosis: Diagnosis, recent: int) -> RemedyFacts:
    """What the remedy policy decides the event from (after ``count_event``, whose count of drops is ``recent``)."""
    trainer, facts, registry, ledger = ctx.trainer, ctx.facts, ctx.registry, ctx.ledger
    guard, restorer, backoff, promoter = registry.guard, registry.restorer, registry.backoff, registry.promoter
    step = facts.step
    scaler_dropped = _scaler_dropped(facts)
    # Under 16-mixed with a LossScaleWatchdog, a run of overflows is the watchdog's (its collapse rule); otherwise
    # GradNormMonitor's max_consecutive_skips counts every dropped step.
    if facts.scaler_overflow and facts.state_ok and registry.scale_watch is not None:
        max_skips = None
    elif guard is not None:
        max_skips = guard.max_consecutive_skips
    else:  # AutoRollback alone still escalates a run of dropped updates (GradNormMonitor's default budget)
        max_skips = DEFAULT_MAX_CONSECUTIVE_SKIPS if restorer is not None else None
    module = diagnosis.module
    watch = registry.scale_watch
    collapse = facts.event.collapse
    fraction, window, on_budget = _dropped_window(registry)
    return RemedyFacts(
        signal=facts.signal,
        cause=diagnosis.cause,
        installed=registry.installed(trainer),
        state_damaged=not facts.state_ok,
        caused_by_data=diagnosis.caused_by_data,
        quarantine_withheld=diagnosis.counterfactual.get("quarantine") is False,
        has_update=bool(facts.readings),
        scaler_dropped=scaler_dropped,
        on_nonfinite=guard.on_nonfinite if guard is not None else "skip",
        on_spike=guard.on_spike if guard is not None else "warn",
        on_collapse=watch.on_collapse if watch is not None else "auto",
        skip_streak=ledger.skip_streak,
        max_consecutive_skips=max_skips,
        backoff_triggers=backoff.triggers if backoff is not None else frozenset(),
        recent_skips=recent,
        skips_before_backoff=backoff.skips_before_backoff if backoff is not None else 3,
        module=module,
        module_overflows=ledger.module_overflows.get(module, 0),
        promote_after=promoter.promote_after if promoter is not None and module not in promoter.promoted else None,
        true_half=isinstance(trainer.precision_plugin, HalfPrecision),
        can_restore=restorer is not None and restorer.can_restore(trainer, step),
        rollback_budget_left=restorer.budget_left(step) if restorer is not None else 1,
        collapse_budget_left=collapse.budget_left if collapse is not None else 1,
        repair_only=bool(repairable_buffers(diagnosis, trainer.lightning_module)) and restorer is not None,
        dropped_before=len(ledger.dropped_steps),
        max_dropped_fraction=fraction,
        dropped_window=window,
        on_dropped_budget=on_budget,
    )


def repairable_buffers(diagnosis: Diagnosis, pl_module: pl.LightningModule) -> list[str]:
    """The non-finite tensors, where they are buffers a batch's forward wrote (BatchNorm statistics) and nothing else:
    the parameters and the optimizer state are sound, so restoring those buffers is the whole repair. ``[]`` else."""
    names = list(diagnosis.state_tensors)
    if not (diagnosis.caused_by_data and names):
        return []
    buffers = {name for name, _ in pl_module.named_buffers()}
    return names if all(n in buffers for n in names) else []


def note_plan(facts: RemedyFacts, plan: Plan, ledger: FitLedger, step: int) -> None:
    """Record what the plan dropped: a drop that counts toward the dropped-updates budget joins its window."""
    if counts_as_dropped(facts, plan):
        ledger.dropped_steps.append(step)
