"""Forensics: on an incident (never on a healthy step), replay the batch to find what caused it and where.

The engine gathers the cheap evidence (``signals.batch``, ``signals.state``, ``signals.history``); when that does not
settle the cause (``policies.diagnosis.needs_replay``), ``investigate`` replays the batch with the origin of its first
non-finite value traced (``replay.trace_pass``, ``origin``: the op, its line, the statistics that explain it), with
hooks on every module and in float32, and adds what it found to the findings the pure policy classifies; ``bundle``
keeps the step for ``nanguard replay``, and ``offline.replay_bundle`` (``lightning_nanguard.replay_bundle``) re-runs it.
See docs/FORENSICS.md.
"""

from lightning_nanguard.forensics.investigation import ReplayBook, ReplayRequest, investigate

__all__ = ["ReplayBook", "ReplayRequest", "investigate"]
