"""Lightning adapters: one thin callback per file over the pure logic in signals/, policies/, recovery/."""

from lightning_nanguard.callbacks.fp32_evaluation import FP32Evaluation
from lightning_nanguard.callbacks.grad_norm_monitor import GradNormMonitor

__all__ = ["FP32Evaluation", "GradNormMonitor"]
