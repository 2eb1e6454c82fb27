"""Pure decisions: readings in, verdicts out. No Lightning, no tensors on the device."""

from lightning_nanguard.policies.skip import SkipBudget
from lightning_nanguard.policies.verdict import Action

__all__ = ["Action", "SkipBudget"]
