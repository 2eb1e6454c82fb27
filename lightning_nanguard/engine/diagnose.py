"""Diagnose (the engine's seam to forensics): the cause of one event, identical on every rank.

The cheap evidence is gathered here: the state check's verdict and names, the batch's own non-finite values, the
GradScaler's facts, the recent history and the resumed checkpoint. ``lightning_nanguard.forensics`` adds a replay of
the batch when that evidence does not settle the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lightning_nanguard import _distributed
from lightning_nanguard.contract import Cause, Diagnosis, Evidence, EvidenceKind, Signal
from lightning_nanguard.engine.sensing import Reading

if TYPE_CHECKING:
    from lightning_nanguard.engine.engine import Engine, PendingEvent

__all__ = ["EventFacts", "diagnose"]

_SPIKES = (Signal.LOSS_SPIKE, Signal.GRAD_NORM_SPIKE, Signal.LOSS_AND_GRAD_NORM_SPIKE)


class EventFacts:
    """What the incident path knows about an event before diagnosing it (all rank-consistent)."""

    def __init__(
        self,
        event: PendingEvent,
        *,
        state_ok: bool,
        state_names: Sequence[str],
        ranks: Sequence[int],
    ) -> None:
        self.event = event
        self.signal = event.signal
        self.readings: list[Reading] = event.readings
        self.state_ok = state_ok
        self.state_names = tuple(state_names)
        self.ranks = tuple(ranks)

    @property
    def scaler_overflow(self) -> bool:
        """A GradScaler overflow of the scaled gradients: loss finite, gradients not, under 16-mixed."""
        return any(r.scale is not None and r.loss_finite and not r.grads_finite for r in self.readings)


def diagnose(engine: Engine, trainer: pl.Trainer, pl_module: pl.LightningModule, facts: EventFacts) -> Diagnosis:
    """The diagnosis of one event. A collective-free function except where it says so (every rank runs it)."""
    from lightning_nanguard.forensics_bridge import investigate

    found = investigate(engine, trainer, pl_module, facts)
    if found is not None:
        return found
    return cheap_diagnosis(engine, trainer, facts)


def cheap_diagnosis(engine: Engine, trainer: pl.Trainer, facts: EventFacts) -> Diagnosis:
    """The cause from cheap evidence alone (no replay)."""
    ranks = facts.ranks
    if not facts.state_ok:
        evidence = [Evidence(EvidenceKind.STATE_NONFINITE, f"non-finite: {', '.join(facts.state_names[:5])}")]
        where = ", ".join(facts.state_names[:3])
        from_ckpt = engine.resumed_from is not None and engine.finite_steps == 0
        if from_ckpt:
            evidence.append(
                Evidence(
                    EvidenceKind.STATE_FROM_CHECKPOINT,
                    f"no finite step since resuming from {engine.resumed_from}",
                    {"checkpoint": engine.resumed_from},
                )
            )
            where = f"{where} (loaded from {engine.resumed_from})"
        rows = _batch_rows(engine, trainer)
        if rows:
            evidence.append(Evidence(EvidenceKind.BATCH_NONFINITE, f"non-finite inputs in batch rows {list(rows)}"))
        return Diagnosis(
            Cause.CORRUPT_STATE,
            where=where,
            evidence=tuple(evidence),
            hint=(
                f"the checkpoint {engine.resumed_from} holds non-finite values: resume from an earlier one"
                if from_ckpt
                else "restore an earlier state (AutoRollback does it in memory); check what wrote the non-finite values"
            ),
            ranks=ranks,
            rows=rows,
            state_tensors=facts.state_names,
            state_damaged=True,
        )
    if facts.signal is Signal.LOSS_SCALE_COLLAPSE or facts.signal in _SPIKES:
        return Diagnosis(
            Cause.GRADIENT_EXPLOSION,
            where="",
            evidence=(Evidence(EvidenceKind.HISTORY_RISING, _history_summary(engine)),),
            hint="lower the learning rate, clip gradients, or use a bigger batch",
            ranks=ranks,
        )
    rows = _batch_rows(engine, trainer)
    if rows:
        return Diagnosis(
            Cause.INPUT_DATA,
            where=f"batch {engine.batch_idx} rows {list(rows)}",
            evidence=(Evidence(EvidenceKind.BATCH_NONFINITE, f"non-finite inputs in batch rows {list(rows)}"),),
            hint="check the data pipeline for these samples (NaN/inf in the inputs)",
            ranks=ranks,
            rows=rows,
        )
    if facts.scaler_overflow:
        scale = next(r.scale for r in facts.readings if r.scale is not None)
        return Diagnosis(
            Cause.HALF_PRECISION_OVERFLOW,
            where=f"gradients at loss scale {scale:g}",
            evidence=(Evidence(EvidenceKind.LOSS_SCALE, f"the scaled gradients overflowed at loss scale {scale:g}"),),
            hint="routine for fp16 with a GradScaler: it dropped the update and lowered its scale",
            ranks=ranks,
        )
    return Diagnosis(Cause.UNKNOWN, ranks=ranks, hint="check the data and the model at this step")


def _batch_rows(engine: Engine, trainer: pl.Trainer) -> tuple[int, ...]:
    """Rows of the current batch holding a non-finite float (this rank), gathered to rank-consistent values."""
    from lightning_nanguard.signals.batch_rows import nonfinite_rows

    local = nonfinite_rows(engine.batch)
    gathered: list[Any] = _distributed.all_gather_objects(trainer, local)
    rows = sorted({r for part in gathered for r in part})
    return tuple(rows)


def _history_summary(engine: Engine) -> str:
    recent = list(engine.history)[-5:]
    if not recent:
        return "no finite step recorded yet"
    norms = ", ".join(f"{g:.3g}" for _, g, _ in recent)
    return f"grad norm over the last {len(recent)} finite steps: {norms}"
