"""What a policy can decide about a step (the enum lives in ``contract``; kept here for existing imports)."""

from __future__ import annotations

from lightning_nanguard.contract import Action

__all__ = ["Action"]
