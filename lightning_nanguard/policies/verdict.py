"""What a policy can decide about a step."""

from __future__ import annotations

from enum import Enum

__all__ = ["Action"]


class Action(str, Enum):
    """The action taken about a step. A ``str`` so incident records and logs carry the plain value."""

    NONE = "none"
    WARN = "warn"
    SKIP = "skip"  # the update was dropped by nanguard (grads set to None)
    SCALER_SKIP = "scaler_skip"  # the GradScaler dropped the update itself; nanguard only counted it
    ROLLBACK = "rollback"
    BACKOFF = "backoff"
    RERUN = "rerun"
    REFUSE = "refuse"
    FALLBACK = "fallback"
    STOP = "stop"
