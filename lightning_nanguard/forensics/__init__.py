"""Forensics: on an incident (never on a healthy step), find what caused it and where.

``investigate`` gathers the cheap evidence (``signals.batch``, ``signals.state``, ``signals.history``), replays the
batch with hooks and in float32 when that evidence does not settle it (``replay``), and asks the pure policy
(``policies.diagnosis.classify``) for the verdict. See docs/FORENSICS.md.
"""

from lightning_nanguard.forensics.investigation import investigate

__all__ = ["investigate"]
