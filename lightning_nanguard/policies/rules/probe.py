"""The probe batch's rule: a spike whose probe loss rose with it is the weights going wrong."""

from __future__ import annotations

from lightning_nanguard.contract import Cause, Diagnosis, Evidence, EvidenceKind, Signal
from lightning_nanguard.policies.findings import Findings, history_evidence

__all__ = ["probe_rose"]


def probe_rose(f: Findings) -> Diagnosis | None:
    """A spike, and the probe batch (a few fixed training samples) scored with the current weights lost more than
    ``factor`` x what it did at the last sound snapshot, or (a spike or a climb of the training loss) gave back a
    share of what it had learned in the recent past as the training loss did: the weights got worse, not just the
    batch unusual. The snapshots taken after the climb began are named (a rollback passes over them)."""
    p = f.probe
    if f.signal is not Signal.PROBE_ROSE or p is None or not p.rose:
        return None
    where = "the weights (the probe batch's loss rose with the spike)"
    if p.by_recent and p.lost is not None:
        what = "the training loss's climb" if p.climb_only else "the spike"
        where = (
            f"the weights (the probe batch gave back {min(p.lost, 9.99):.0%} of what it had learned by step "
            f"{p.lately_step}, with {what})"
        )
    if p.unsound:
        where += f"; the snapshots of steps {list(p.unsound)} were taken during the climb"
    return Diagnosis(
        Cause.WEIGHTS_DIVERGING,
        where=where,
        evidence=(Evidence(EvidenceKind.PROBE_LOSS, p.summary(), p.values()), history_evidence(f)),
    )
