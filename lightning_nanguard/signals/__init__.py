"""Pure tensor reductions: no Lightning, no logging, no host reads."""

from lightning_nanguard.signals.gradients import GradReading, ParamIndex, grad_reading, layer_norms

__all__ = ["GradReading", "ParamIndex", "grad_reading", "layer_norms"]
