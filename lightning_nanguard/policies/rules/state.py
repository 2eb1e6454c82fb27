"""Rules on a non-finite state (parameters, buffers, optimizer tensors): tried first, since a damaged state decides
the remedy whatever else the event shows."""

from __future__ import annotations

from lightning_nanguard.contract import Cause, Diagnosis, Evidence, EvidenceKind, Signal
from lightning_nanguard.policies.findings import Findings, at, batch_evidence, rows_by_rank

__all__ = ["corrupt_state", "grown_state", "loaded_from_checkpoint", "optimizer_update"]


def _state_evidence(f: Findings) -> Evidence:
    names = f.state.names
    listed = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
    return Evidence(EvidenceKind.STATE_NONFINITE, f"non-finite: {listed}", {"tensors": names})


def loaded_from_checkpoint(f: Findings) -> Diagnosis | None:
    """The state is non-finite and no step was finite since resuming from a checkpoint: the checkpoint holds it."""
    if f.state_ok or f.resumed_from is None or f.finite_steps != 0:
        return None
    names = f.state.names
    return Diagnosis(
        Cause.CORRUPT_STATE,
        where=f"{', '.join(names[:3])} (loaded from {f.resumed_from})",
        evidence=(
            _state_evidence(f),
            Evidence(
                EvidenceKind.STATE_FROM_CHECKPOINT,
                f"no finite step since resuming from {f.resumed_from}",
                {"checkpoint": f.resumed_from},
            ),
        ),
        hint=f"the checkpoint {f.resumed_from} holds non-finite values: resume from an earlier one",
        state_tensors=names,
        state_damaged=True,
    )


def optimizer_update(f: Findings) -> Diagnosis | None:
    """The step before was finite, and the Adam update recomputed from its finite moments is non-finite for the
    damaged parameters, or eps underflows in their dtype: the optimizer's numerics made the weights non-finite."""
    s = f.state
    if f.state_ok or not f.last_step_finite or not s.parameters:
        return None
    damaged = set(s.parameters)
    by_update = [n for n in s.update_nonfinite if n in damaged]
    if not (by_update or s.eps_underflow):
        return None
    evidence = [_state_evidence(f)]
    if by_update:
        evidence.append(
            Evidence(
                EvidenceKind.GRADS_FINITE_UPDATE_NOT,
                f"the last step's gradients were finite, and the Adam update recomputed from its finite moments "
                f"is non-finite for {', '.join(by_update[:3])}",
                {"parameters": tuple(by_update)},
            )
        )
    evidence.extend(Evidence(EvidenceKind.EPS_UNDERFLOW, line) for line in s.eps_underflow)
    return Diagnosis(
        Cause.OPTIMIZER_NUMERICS,
        where=f"the optimizer update of {', '.join((by_update or list(s.parameters))[:3])}",
        evidence=tuple(evidence),
        state_tensors=s.names,
        state_damaged=True,
    )


def corrupt_state(f: Findings) -> Diagnosis | None:
    """Any other non-finite state. Non-finite buffers name the module that owns them, and the batch whose forward
    wrote them is the suspect (its rows, or the whole batch when this step's own loss went non-finite)."""
    if f.state_ok:
        return None
    s = f.state
    evidence = [_state_evidence(f)]
    where = ", ".join(s.names[:3])
    ranks: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    this_batch = False
    if s.buffers:
        # A forward pass writes buffers (BatchNorm statistics): the batch that ran it is the suspect.
        evidence.extend(batch_evidence(f))
        for attr in ("nonfinite_rows", "magnitude_rows"):
            ranks, rows = rows_by_rank(f, attr)
            if rows:
                break
        owners = ", ".join(s.buffer_modules[:3])
        where = f"{', '.join(s.buffers[:3])}, written by the forward of {owners or 'the model'}"
        # This step's loss went non-finite while every parameter is finite: its own forward produced the values the
        # buffers folded in, so this batch is the suspect even when no row stands out (a uniformly bad shard).
        this_batch = f.signal in (Signal.NONFINITE_LOSS, Signal.NONFINITE_LOSS_AND_GRADS) and not s.parameters
        if rows:
            where += f" on {at(f, ranks, rows)}"
        elif this_batch:
            where += f" on batch {f.batch_idx} (every row: none stands out)"
        if s.parameters:
            where += f"; also {', '.join(s.parameters[:3])}"
    return Diagnosis(
        Cause.CORRUPT_STATE,
        where=where,
        evidence=tuple(evidence),
        ranks=ranks,
        rows=rows,
        state_tensors=s.names,
        state_damaged=True,
        caused_by_data=bool(rows) or (bool(s.buffers) and this_batch),
    )


def grown_state(f: Findings) -> Diagnosis | None:
    """Finite damage: parameters whose largest |value| grew by orders of magnitude since the last sound snapshot (a
    few finite updates at a too-high learning rate blow the weights up long before a value overflows). The state is
    damaged whatever the non-finite value that followed looks like: roll back and lower the learning rate."""
    g = f.grown
    if g is None or not g.parameters:
        return None
    shown = ", ".join(f"{n} {now:.3g} (was {was:.3g})" for n, now, was in g.parameters[:3])
    more = f" (+{len(g.parameters) - 3} more)" if len(g.parameters) > 3 else ""
    return Diagnosis(
        Cause.GRADIENT_EXPLOSION,
        where=f"parameters grown since the snapshot of step {g.reference_step}: {shown}{more}",
        evidence=(
            Evidence(
                EvidenceKind.STATE_GROWN,
                f"the largest |value| of {len(g.parameters)} parameter(s) grew more than {g.factor:g}x since the "
                f"last sound snapshot (step {g.reference_step}): {shown}{more}",
                {
                    "reference_step": g.reference_step,
                    "factor": g.factor,
                    "parameters": [list(p) for p in g.parameters],
                },
            ),
        ),
        hint="a few finite updates blew the weights up: lower the learning rate, clip gradients, warm up longer",
        state_tensors=tuple(n for n, _, _ in g.parameters),
        state_damaged=True,
    )
