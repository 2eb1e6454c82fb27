"""Lightning adapters: one thin callback per file over the pure logic in signals/, policies/, recovery/."""

from lightning_nanguard.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_nanguard.callbacks.loss_scale_watchdog import LossScaleWatchdog

__all__ = ["GradNormMonitor", "LossScaleWatchdog"]
