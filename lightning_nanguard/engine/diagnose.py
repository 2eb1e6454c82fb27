"""Diagnose: the cause of one training-step event, identical on every rank.

The cheap evidence is gathered here (``gather_findings``): the batch's non-finite, outlying and out-of-range values
(``signals.batch``), the non-finite state by kind and the optimizer's part in it (``signals.state``), the recent
history (``signals.history``), the GradScaler's facts, the resumed checkpoint and, for a ``diverging`` event (which,
like a non-finite state found at a snapshot, has no step reading), the restorer's verdict on the snapshot. Each rank
reads its own and one all-gather makes it everyone's, so ``policies.diagnosis.classify`` decides the same on every
rank. ``lightning_nanguard.forensics`` adds a replay of the batch when that evidence does not settle the cause, and
traces the origin of its first non-finite value; ``write_incident_bundle`` then keeps that step for ``nanguard
replay``, and ``trigger_note`` says so where a formula bug's triggering records were quarantined.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_nanguard import _distributed
from lightning_nanguard.config.grad_norm_monitor import MAX_REPLAY_STEPS
from lightning_nanguard.contract import Action, Diagnosis, Divergence, Signal
from lightning_nanguard.engine.context import IncidentContext
from lightning_nanguard.engine.counterfactual import test_blame
from lightning_nanguard.engine.events import EventFacts
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.engine.state_growth import LocalGrowth, local_growth
from lightning_nanguard.engine.state_growth import merge as merge_growth
from lightning_nanguard.forensics import ReplayRequest, investigate
from lightning_nanguard.forensics.bundle import DEFAULT_BUDGET_MB, write_bundle
from lightning_nanguard.policies.causes import CAUSES
from lightning_nanguard.policies.diagnosis import classify, needs_replay
from lightning_nanguard.policies.findings import Findings
from lightning_nanguard.signals.batch import BatchFindings, read_batch
from lightning_nanguard.signals.history import read_history
from lightning_nanguard.signals.model_tensors import nonfinite_names
from lightning_nanguard.signals.state import StateFindings, read_state

__all__ = ["diagnose", "gather_findings", "is_half", "precision_of", "trigger_note", "write_incident_bundle"]


def diagnose(ctx: IncidentContext) -> Diagnosis:
    """The diagnosis of one event: the cheap evidence (one all-gather), and a replay when that does not settle it
    (``forensics``). Every rank runs it; its collectives are made by every rank in the same order."""
    trainer, pl_module, facts, registry, ledger = ctx.trainer, ctx.pl_module, ctx.facts, ctx.registry, ctx.ledger
    findings = gather_findings(ctx)
    if needs_replay(findings):
        guard = registry.guard
        request = ReplayRequest(
            facts.batch,
            facts.batch_idx,
            facts.step,
            mode=guard.forensics if guard is not None else "first",
            max_replay_steps=guard.max_replay_steps if guard is not None else MAX_REPLAY_STEPS,
            has_step=bool(facts.readings),
            update_applied=bool(facts.readings) and not all(r.dropped for r in facts.readings),
        )
        findings = investigate(trainer, pl_module, findings, request, ledger.replays)
    diagnosis = classify(findings)
    # A chain of quarantines that did not stop the fault: its blame is withdrawn.
    diagnosis = ledger.blames.judge(findings, diagnosis, facts.step)
    # A data blame is a hypothesis: the step without the blamed rows says whether to quarantine them.
    return test_blame(ctx, findings, diagnosis)


def write_incident_bundle(ctx: IncidentContext, diagnosis: Diagnosis) -> str:
    """The incident's bundle (``forensics.bundle``: the batch, the random states, the precision, the optimizers, the
    module's import path and state within ``GradNormMonitor(bundle_mb=...)``, the origin and this diagnosis) under
    ``log_dir``, where a replay ran for this incident: its path, the same on every rank ("" when none was written).

    Call it before any action changes the weights or the random state (a rollback restores both). The rank whose
    replay reproduced first writes it; one all-gather tells every rank the outcome (every rank is here: whether a
    replay ran, and which rank writes, come from gathered values)."""
    trainer, pl_module, facts, registry, log_dir = ctx.trainer, ctx.pl_module, ctx.facts, ctx.registry, ctx.run_dir
    book = ctx.ledger.replays
    traced, book.traced = book.traced, None
    budget = registry.guard.bundle_mb if registry.guard is not None else DEFAULT_BUDGET_MB
    if not diagnosis.replayed or traced is None or budget <= 0 or not trainer.loggers:
        return ""
    mine: tuple[str, str] | None = None
    if trainer.global_rank == book.bundle_rank:
        if log_dir is None:
            mine = ("", "no log dir")
        else:
            try:
                written = write_bundle(
                    log_dir,
                    trainer,
                    pl_module,
                    facts.batch,
                    facts.batch_idx,
                    traced,
                    budget_mb=budget,
                    diagnosis=diagnosis.to_dict(),
                    step=facts.step,
                )
                mine = (written.path or "", written.reason)
            except Exception as exc:  # a bundle must never take training down, nor leave the other ranks waiting
                mine = ("", f"writing it failed: {type(exc).__name__}: {exc}".splitlines()[0][:200])
    outcome = cast(tuple[str, str], _distributed.all_gather_objects(trainer, mine)[book.bundle_rank])
    path, reason = outcome
    if not path:
        rank_zero_info(f"nanguard: no incident bundle for step {facts.step}: {reason}")
    return path


def trigger_note(details: dict[Action, str], diagnosis: Diagnosis) -> None:
    """Where the records quarantined are valid data that trigger a formula bug (``caused_by_data`` with a cause whose
    data is not at fault, decided from the origin), the quarantine's sentence says so."""
    done = details.get(Action.QUARANTINE)
    if done and diagnosis.caused_by_data and diagnosis.origin and not CAUSES[diagnosis.cause].data_at_fault:
        details[Action.QUARANTINE] = f"{done}, as the trigger of a formula bug (the fix is in the formula: the hint)"


def precision_of(trainer: pl.Trainer) -> str:
    """The Trainer's precision as Lightning names it (``"16-mixed"``, ``"bf16-true"``, ``"32-true"``, ...)."""
    return str(getattr(trainer.precision_plugin, "precision", "32-true"))


def is_half(precision: str) -> bool:
    return precision.startswith(("16", "bf16"))


def gather_findings(ctx: IncidentContext) -> Findings:
    """Every rank's cheap evidence, made rank-consistent with one all-gather (every rank calls this)."""
    trainer, pl_module, facts, registry, ledger = ctx.trainer, ctx.pl_module, ctx.facts, ctx.registry, ctx.ledger
    optimizers = list(trainer.optimizers)
    local_batch = read_batch(facts.batch)
    local_state = None if facts.state_ok else read_state(pl_module, optimizers, nonfinite_names(pl_module, optimizers))
    # Each rank's clock too: a budget decided from one rank's step time could send the ranks different ways. And the
    # parameters' growth since the last sound snapshot (finite damage), where AutoRollback keeps one in memory.
    local = (local_batch, local_state, float(ledger.step_seconds), local_growth(registry, pl_module, facts))
    gathered = cast(
        list[tuple[BatchFindings, StateFindings | None, float, LocalGrowth | None]],
        _distributed.all_gather_objects(trainer, local),
    )
    batches: tuple[BatchFindings, ...] = tuple(g[0] for g in gathered)
    state = _merge_states([g[1] for g in gathered if g[1] is not None], facts.state_names)
    clocks = [g[2] for g in gathered if math.isfinite(g[2]) and g[2] > 0]
    step = facts.step
    history = list(ledger.history)
    scale = next((r.scale for r in facts.readings if r.scale is not None), None)
    precision = precision_of(trainer)
    return Findings(
        signal=facts.signal,
        ranks=facts.ranks,
        state_ok=facts.state_ok,
        state=state,
        last_step_finite=bool(history) and history[-1][0] == step - 1,
        batch=batches,
        history=read_history(history),
        resumed_from=ledger.resumed_from,
        finite_steps=ledger.finite_steps,
        batch_idx=facts.batch_idx,
        scale=scale,
        scaler_overflow=facts.scaler_overflow,
        half_precision=is_half(precision),
        precision=precision,
        step_seconds=max(clocks) if clocks else math.nan,
        divergence=_divergence(facts, registry),
        probe=registry.restorer.probe_verdict
        if facts.signal is Signal.PROBE_ROSE and registry.restorer is not None
        else None,
        grown=merge_growth([g[3] for g in gathered]),
    )


def _divergence(facts: EventFacts, registry: Registry) -> Divergence | None:
    """What the restorer saw when it reported a ``diverging`` event (rank-consistent: judged from the engine's reduced
    history). ``None`` for any other event, or a restorer that does not say."""
    if facts.signal is not Signal.DIVERGING or registry.restorer is None:
        return None
    return registry.restorer.divergence


def _merge_states(parts: list[StateFindings], names: Sequence[str]) -> StateFindings:
    """The union over ranks, in a stable order; ``names`` (the engine's gathered list) when no rank found any."""

    def union(attr: str) -> tuple[str, ...]:
        out: list[str] = []
        for part in parts:
            out.extend(n for n in getattr(part, attr) if n not in out)
        return tuple(out)

    if not parts:
        return StateFindings(parameters=tuple(names)) if names else StateFindings()
    return StateFindings(
        parameters=union("parameters"),
        buffers=union("buffers"),
        optimizer=union("optimizer"),
        buffer_modules=union("buffer_modules"),
        update_nonfinite=union("update_nonfinite"),
        eps_underflow=union("eps_underflow"),
    )
