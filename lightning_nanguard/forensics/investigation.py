"""One event's forensics: the cheap evidence, then (when it does not settle the cause) a replay, then the verdict.

Every rank runs this with the same rank-consistent facts and makes the same collectives in the same order: one
all-gather of the cheap evidence, then, only if the gathered evidence calls for a replay, one all-gather of each
replay pass. Whether to replay, and whether to add the float32 pass, is decided from gathered values only, so no rank
can wait on a collective another rank skipped.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import lightning.pytorch as pl

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.contract import Diagnosis
from lightning_nanguard.engine.diagnose import event_step, gather_findings
from lightning_nanguard.forensics.replay import run_pass
from lightning_nanguard.policies.diagnosis import (
    Findings,
    PassResult,
    ReplayFindings,
    classify,
    needs_replay,
    replay_steps,
    signature,
)
from lightning_nanguard.signals.batch import BatchFindings, read_batch

if TYPE_CHECKING:
    from lightning_nanguard.engine.diagnose import EventFacts
    from lightning_nanguard.engine.engine import Engine

__all__ = ["investigate"]


def investigate(engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, facts: EventFacts) -> Diagnosis:
    """The diagnosis of one event, honouring ``GradNormMonitor(forensics=..., max_replay_steps=...)``."""
    findings = gather_findings(engine, trainer, pl_module, facts)
    if not needs_replay(findings):
        return classify(findings)
    guard = engine.guard
    mode = guard.forensics if guard is not None else "first"
    if mode == "off":
        return classify(dataclasses.replace(findings, note="forensics='off': cheap evidence only"))
    why_not = _why_not(engine, trainer, pl_module, findings, facts)
    if why_not:
        return classify(dataclasses.replace(findings, note=f"replay skipped ({why_not}): cheap evidence only"))
    key = signature(findings)
    cached = engine.diagnoses.get(key) if mode == "first" else None
    if cached is not None:
        step, replays = cached
        findings = _check_targets(engine, trainer, findings, replays)
        return classify(
            dataclasses.replace(findings, replay=replays, note=f"reused the replay of step {step} (forensics='first')")
        )
    replays, ms = _replay(engine, trainer, pl_module, findings)
    findings = _check_targets(engine, trainer, findings, replays)
    ms = round(ms, 3)  # the slowest rank's time, the same number on every rank
    engine.replay_ms += ms
    if any(r.hooked is not None and r.hooked.reproduced for r in replays):
        # Only a reproduced fault establishes a cause worth reusing: "did not reproduce" says nothing of the next one.
        engine.diagnoses[key] = (event_step(trainer, facts), replays)
    undone = ""
    if facts.readings and not all(r.dropped for r in facts.readings):
        undone = "the update was applied: replayed on the post-update weights"
    return classify(
        dataclasses.replace(
            findings,
            replay=replays,
            replayed_now=True,
            replay_ms=ms,
            replay_steps=replay_steps(ms, findings.step_seconds),
            note=undone,
        )
    )


def _check_targets(engine: Engine, trainer: pl.Trainer, f: Findings, replays: tuple[ReplayFindings, ...]) -> Findings:
    """Check the class targets against the output size the replay saw (one all-gather, only when the gathered target
    ranges say some label may not fit: a decision every rank makes alike)."""
    size = next((r.hooked.out_size for r in replays if r.hooked is not None and r.hooked.out_size), None)
    if size is None:
        return f
    f = dataclasses.replace(f, output_size=size)
    suspect = any(
        b.target_min is not None and b.target_max is not None and (b.target_min < 0 or b.target_max >= size)
        for b in f.batch
    )
    if not suspect:
        return f
    gathered: list[BatchFindings] = _distributed.all_gather_objects(trainer, read_batch(engine.batch, size))  # type: ignore[assignment]
    return dataclasses.replace(f, batch=tuple(gathered))


def _budget_ms(engine: Engine, f: Findings) -> float:
    """Replay time allowed in this fit (inf while the step time is unknown). Rank-consistent: the gathered step time
    and ``engine.replay_ms``, which only ever grows by gathered amounts."""
    limit = engine.guard.max_replay_steps if engine.guard is not None else 20.0
    if not math.isfinite(f.step_seconds) or f.step_seconds <= 0:
        return math.inf
    return limit * f.step_seconds * 1000.0


def _why_not(engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, f: Findings, facts: EventFacts) -> str:
    """Why this event cannot be replayed ("" when it can). Rank-consistent inputs only."""
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if accumulate > 1:
        return f"gradient accumulation: accumulate_grad_batches={accumulate}, only the last micro-batch is at hand"
    if not pl_module.automatic_optimization:
        return "manual optimization: training_step steps the optimizers itself"
    if not facts.readings:
        return "no training step at hand"
    if not f.batch or not all(b.replayable for b in f.batch):
        return "the batch cannot be replayed"
    if engine.replay_ms >= _budget_ms(engine, f):
        limit = engine.guard.max_replay_steps if engine.guard is not None else 20.0
        return f"the replay budget is spent: {engine.replay_ms:.0f} ms, max_replay_steps={limit:g}"
    return ""


def _replay(
    engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, f: Findings
) -> tuple[tuple[ReplayFindings, ...], float]:
    """The hooked pass on every rank, then the float32 pass on every rank where a half-precision run reproduced."""
    scale = f.scale if _lightning_compat.get_scaler(trainer) is not None else None
    hooked = run_pass(trainer, pl_module, engine.batch, engine.batch_idx, float32=False, scale=scale)
    first: list[PassResult] = _distributed.all_gather_objects(trainer, hooked)  # type: ignore[assignment]
    ms = max(p.ms for p in first)
    fp32: list[PassResult | None] = [None] * len(first)
    # The float32 pass costs about what the first did: run it only when that still fits the budget.
    if f.half_precision and any(p.reproduced for p in first) and engine.replay_ms + 2 * ms <= _budget_ms(engine, f):
        mine = run_pass(trainer, pl_module, engine.batch, engine.batch_idx, float32=True)
        gathered: list[PassResult] = _distributed.all_gather_objects(trainer, mine)  # type: ignore[assignment]
        fp32 = list(gathered)
        ms += max(p.ms for p in gathered)
    replays = tuple(_findings(h, x) for h, x in zip(first, fp32, strict=True))
    return replays, ms


def _findings(hooked: PassResult, fp32: PassResult | None) -> ReplayFindings:
    return ReplayFindings(hooked=hooked, fp32=fp32, ms=hooked.ms + (fp32.ms if fp32 is not None else 0.0))
