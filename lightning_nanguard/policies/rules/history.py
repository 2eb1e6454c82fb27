"""The last rules, when neither the cheap evidence nor a replay decided: the history, else ``unknown``."""

from __future__ import annotations

from lightning_nanguard.contract import Cause, Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.policies.findings import Findings, history_evidence

__all__ = ["nothing_decided", "rising_history"]


def _failed(f: Findings) -> str:
    errors = f.replay_errors
    return f"replay failed: {errors[0]}" if errors else ""


def rising_history(f: Findings) -> Diagnosis | None:
    """The grad norm or the loss was rising over the last finite steps."""
    if not f.history.rising:
        return None
    return Diagnosis(Cause.GRADIENT_EXPLOSION, evidence=(history_evidence(f),), note=_failed(f))


def nothing_decided(f: Findings) -> Diagnosis | None:
    """Nothing above: ``unknown``, with why no replay ran (or why it failed)."""
    skipped = (Evidence(EvidenceKind.REPLAY_SKIPPED, f.note),) if f.note else ()
    return Diagnosis(Cause.UNKNOWN, evidence=skipped, note=_failed(f))
