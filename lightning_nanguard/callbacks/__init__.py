"""Lightning adapters: one thin callback per file over the pure logic in signals/, policies/, recovery/."""

from lightning_nanguard.callbacks.auto_rollback import AutoRollback
from lightning_nanguard.callbacks.grad_norm_monitor import GradNormMonitor

__all__ = ["AutoRollback", "GradNormMonitor"]
