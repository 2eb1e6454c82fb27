"""Pure tensor reductions: no Lightning, no logging, no host reads."""

from lightning_nanguard.signals.gradients import GradNorms, ParamIndex, grad_norms, layer_norms

__all__ = ["GradNorms", "ParamIndex", "grad_norms", "layer_norms"]
