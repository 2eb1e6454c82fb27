"""One event's replay, when the cheap evidence does not settle its cause: the findings completed, or a note why not.

The first pass is traced (``replay.trace_pass``): besides the modules and the loss, it finds the origin of the first
non-finite value (the op, its line, the statistics that explain it), which the evidence rules read first. Every rank
runs this with the same rank-consistent findings and makes the same collectives in the same order: one all-gather
of each replay pass, the origin with it (and one of the batch's targets when the replay's output size says a label
may not fit). Whether to replay, and whether to add the float32 pass, is decided from gathered values only, so no
rank can wait on a collective another rank skipped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import lightning.pytorch as pl

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.config.grad_norm_monitor import MAX_REPLAY_STEPS
from lightning_nanguard.forensics.origin_events import batch_fields
from lightning_nanguard.forensics.replay import TracedPass, run_pass, trace_pass
from lightning_nanguard.policies.diagnosis import replay_steps, signature
from lightning_nanguard.policies.findings import Findings, PassResult, ReplayFindings
from lightning_nanguard.signals.batch import BatchFindings, read_batch, target_tensor

__all__ = ["TRACE_S", "ReplayBook", "ReplayRequest", "investigate"]

TRACE_S = 60.0  # the origin trace's longest run, in seconds (and never past the replay budget left)


@dataclass
class ReplayBook:
    """Forensics over one fit: the replay time spent, and the replays kept per evidence signature
    (``forensics="first"``). Rank-consistent: both only ever change by gathered values."""

    spent_ms: float = 0.0
    kept: dict[tuple[object, ...], tuple[int, tuple[ReplayFindings, ...]]] = field(default_factory=dict)
    # This rank's traced pass of the replay just run, and the rank whose bundle is written (the first that
    # reproduced): read once by the incident's bundle (``engine.diagnose.write_incident_bundle``), then cleared.
    traced: TracedPass | None = None
    bundle_rank: int = 0

    def forget(self) -> None:
        """The model or the optimizer changed (a rollback, a promotion, an eps backoff): a kept replay no longer
        describes them."""
        self.kept.clear()


@dataclass(frozen=True)
class ReplayRequest:
    """The event to replay and the rules for it (``GradNormMonitor(forensics=..., max_replay_steps=...)``).

    Attributes:
        batch: the event's batch, as the training step received it.
        batch_idx: its index in the epoch.
        step: the event's step.
        mode: ``"first"``, ``"every"`` or ``"off"``.
        max_replay_steps: replays stop once they cost this many training steps' worth of time in this fit.
        has_step: a training step is at hand (not an event found outside a step).
        update_applied: some update of the step was not dropped (the replay then runs on post-update weights).
    """

    batch: object
    batch_idx: int
    step: int
    mode: str = "first"
    max_replay_steps: float = MAX_REPLAY_STEPS
    has_step: bool = True
    update_applied: bool = False


def investigate(
    trainer: pl.Trainer, pl_module: pl.LightningModule, findings: Findings, request: ReplayRequest, book: ReplayBook
) -> Findings:
    """``findings`` with a replay of the event's batch (run now, or the one kept for the same evidence), or with a
    note saying why there is none."""
    book.traced = None
    if request.mode == "off":
        return dataclasses.replace(findings, note="forensics='off': cheap evidence only")
    why_not = _why_not(trainer, pl_module, findings, request)
    if why_not:
        return dataclasses.replace(findings, note=f"replay skipped ({why_not}): cheap evidence only")
    key = signature(findings)
    kept = book.kept.get(key) if request.mode == "first" else None
    spent = book.spent_ms >= _budget_ms(findings, request)
    # A kept replay costs nothing. One whose records triggered the fault is traced again while the budget allows:
    # they were that batch's, and a quarantine needs this batch's own.
    if kept is not None and (spent or not _triggers(kept[1])):
        step, replays = kept
        note = f"reused the replay of step {step} (forensics='first')"
        if _triggers(replays):
            replays = tuple(_without_rows(r) for r in replays)
            note += ": the records that triggered it were that batch's, this batch's are not known"
        findings = _check_targets(trainer, findings, replays, request.batch)
        return dataclasses.replace(findings, replay=replays, note=note)
    if spent:
        why_not = f"the replay budget is spent: {book.spent_ms:.0f} ms, max_replay_steps={request.max_replay_steps:g}"
        return dataclasses.replace(findings, note=f"replay skipped ({why_not}): cheap evidence only")
    replays, ms = _replay(trainer, pl_module, findings, request, book)
    findings = _check_targets(trainer, findings, replays, request.batch)
    ms = round(ms, 3)  # the slowest rank's time, the same number on every rank
    book.spent_ms += ms
    if any(r.hooked is not None and r.hooked.reproduced for r in replays):
        # Only a reproduced fault establishes a cause worth reusing: "did not reproduce" says nothing of the next one.
        book.kept[key] = (request.step, replays)
    return dataclasses.replace(
        findings,
        replay=replays,
        replayed_now=True,
        replay_ms=ms,
        replay_steps=replay_steps(ms, findings.step_seconds),
        note="the update was applied: replayed on the post-update weights" if request.update_applied else "",
    )


def _triggers(replays: tuple[ReplayFindings, ...]) -> bool:
    """Some replay's origin names the records that trigger it (``Origin.trigger_rows``)."""
    return any(r.hooked is not None and r.hooked.origin is not None and r.hooked.origin.trigger_rows for r in replays)


def _without_rows(r: ReplayFindings) -> ReplayFindings:
    """``r`` with its origin's rows left out (another batch's rows name nothing in this one)."""
    if r.hooked is None or r.hooked.origin is None:
        return r
    origin = dataclasses.replace(r.hooked.origin, rows=())
    return dataclasses.replace(r, hooked=dataclasses.replace(r.hooked, origin=origin))


def _check_targets(trainer: pl.Trainer, f: Findings, replays: tuple[ReplayFindings, ...], batch: object) -> Findings:
    """Check the class targets against the output size the replay saw (one all-gather, only when the gathered target
    ranges say some label may not fit: a decision every rank makes alike)."""
    size = next((r.hooked.out_size for r in replays if r.hooked is not None and r.hooked.out_size), None)
    if size is None or _conditions_the_model(batch, replays):
        return f
    f = dataclasses.replace(f, output_size=size)
    suspect = any(
        b.target_min is not None and b.target_max is not None and (b.target_min < 0 or b.target_max >= size)
        for b in f.batch
    )
    if not suspect:
        return f
    gathered: list[BatchFindings] = _distributed.all_gather_objects(trainer, read_batch(batch, size))
    return dataclasses.replace(f, batch=tuple(gathered))


def _conditions_the_model(batch: object, replays: tuple[ReplayFindings, ...]) -> bool:
    """The batch's integer "targets" index a parameter's rows in the replay (a class-conditional model's labels go
    through an embedding): they condition the model, the loss does not consume them as targets. Rank-consistent
    where every rank's batch has the same structure (the fields are named by position or key)."""
    target = target_tensor(batch)
    used = {f for r in replays if r.hooked is not None for f in r.hooked.index_fields}
    if target is None or not used:
        return False
    return any(t is target and name in used for name, t in batch_fields(batch))


def _budget_ms(f: Findings, request: ReplayRequest) -> float:
    """Replay time allowed in this fit (inf while the step time is unknown). Rank-consistent: the gathered step
    time."""
    if not math.isfinite(f.step_seconds) or f.step_seconds <= 0:
        return math.inf
    return request.max_replay_steps * f.step_seconds * 1000.0


def _why_not(trainer: pl.Trainer, pl_module: pl.LightningModule, f: Findings, request: ReplayRequest) -> str:
    """Why this event cannot be replayed, nor a kept replay reused ("" when it can; the budget is checked apart, as
    a kept replay costs nothing). Rank-consistent inputs only."""
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if accumulate > 1:
        return f"gradient accumulation: accumulate_grad_batches={accumulate}, only the last micro-batch is at hand"
    if not request.has_step:
        return "no training step at hand"
    if not f.batch or not all(b.replayable for b in f.batch):
        return "the batch cannot be replayed"
    return ""


def _replay(
    trainer: pl.Trainer, pl_module: pl.LightningModule, f: Findings, request: ReplayRequest, book: ReplayBook
) -> tuple[tuple[ReplayFindings, ...], float]:
    """The traced pass on every rank, then the float32 pass on every rank where a half-precision run reproduced."""
    scale = f.scale if _lightning_compat.get_scaler(trainer) is not None else None
    left_s = (_budget_ms(f, request) - book.spent_ms) / 1000.0  # the trace stops there (the pass runs on)
    # The step as it ran: its own global_step and epoch (Lightning counted the step before the replay).
    step, epoch = request.step, trainer.current_epoch
    traced = trace_pass(
        trainer,
        pl_module,
        request.batch,
        request.batch_idx,
        scale=scale,
        time_budget_s=min(TRACE_S, left_s),
        step=step,
        epoch=epoch,
    )
    book.traced = traced
    first: list[PassResult] = _distributed.all_gather_objects(trainer, traced.result)
    book.bundle_rank = next((r for r, p in enumerate(first) if p.reproduced), 0)
    ms = max(p.ms for p in first)
    fp32: list[PassResult | None] = [None] * len(first)
    # The float32 pass costs about a training step (the traced pass, more: it checks every op): run it only when
    # that still fits the budget.
    step_ms = f.step_seconds * 1000.0 if math.isfinite(f.step_seconds) and f.step_seconds > 0 else ms
    if f.half_precision and any(p.reproduced for p in first) and book.spent_ms + ms + step_ms <= _budget_ms(f, request):
        mine = run_pass(trainer, pl_module, request.batch, request.batch_idx, float32=True, step=step, epoch=epoch)
        gathered: list[PassResult] = _distributed.all_gather_objects(trainer, mine)
        fp32 = list(gathered)
        ms += max(p.ms for p in gathered)
    replays = tuple(
        ReplayFindings(hooked=h, fp32=x, ms=h.ms + (x.ms if x is not None else 0.0))
        for h, x in zip(first, fp32, strict=True)
    )
    return replays, ms
