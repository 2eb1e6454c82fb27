"""Decide: the facts the remedy policy decides one event from, gathered from what is installed and recorded.

Counting happens here too, once per event: a dropped update that counts toward OptimizerBackoff's skip rule, and a
half-precision overflow of the module the diagnosis named (each as the cause declares, ``policies.causes``).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import HalfPrecision

from lightning_nanguard.contract import Diagnosis, Signal
from lightning_nanguard.engine.accounting import FitLedger
from lightning_nanguard.engine.capabilities import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lightning_nanguard.engine.events import EventFacts
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.policies.causes import CAUSES
from lightning_nanguard.policies.remedy import RemedyFacts

__all__ = ["remedy_facts"]


def remedy_facts(
    trainer: pl.Trainer, facts: EventFacts, diagnosis: Diagnosis, registry: Registry, ledger: FitLedger
) -> RemedyFacts:
    guard, restorer, backoff, promoter = registry.guard, registry.restorer, registry.backoff, registry.promoter
    step = facts.step
    scaler_dropped = any(r.dropped and r.scale is not None and r.bad for r in facts.readings)
    # Under 16-mixed with a LossScaleWatchdog, a run of overflows is the watchdog's (its collapse rule); otherwise
    # GradNormMonitor's max_consecutive_skips counts every dropped step.
    if facts.scaler_overflow and facts.state_ok and registry.scale_watch is not None:
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
        ledger.recent_skips.append(step)
        recent = sum(1 for s in ledger.recent_skips if step - s < backoff.skip_window)
    module = diagnosis.module
    if module and cause.counts_module_overflow:
        ledger.module_overflows[module] = ledger.module_overflows.get(module, 0) + 1
    watch = registry.scale_watch
    collapse = facts.event.collapse
    return RemedyFacts(
        signal=facts.signal,
        cause=diagnosis.cause,
        installed=registry.installed(trainer),
        state_damaged=not facts.state_ok,
        caused_by_data=diagnosis.caused_by_data,
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
    )
