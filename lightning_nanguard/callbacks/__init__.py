"""Lightning adapters: one thin callback per file over the pure logic in signals/, policies/, recovery/."""

from lightning_nanguard.callbacks.auto_rollback import AutoRollback
from lightning_nanguard.callbacks.checkpoint_guard import CheckpointGuard
from lightning_nanguard.callbacks.fp32_evaluation import FP32Evaluation
from lightning_nanguard.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_nanguard.callbacks.loss_scale_watchdog import LossScaleWatchdog
from lightning_nanguard.callbacks.optimizer_backoff import OptimizerBackoff
from lightning_nanguard.callbacks.precision_headroom import PrecisionHeadroom

__all__ = [
    "AutoRollback",
    "CheckpointGuard",
    "FP32Evaluation",
    "GradNormMonitor",
    "LossScaleWatchdog",
    "OptimizerBackoff",
    "PrecisionHeadroom",
]
