"""lightning_nanguard: composable PyTorch Lightning callbacks that keep training numerically healthy."""

from lightning_nanguard.callbacks import (
    AutoRollback,
    CheckpointGuard,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    OptimizerBackoff,
    PrecisionHeadroom,
)
from lightning_nanguard.checkpointing.verify import last_good_checkpoint, verify_checkpoint
from lightning_nanguard.contract import Action
from lightning_nanguard.exceptions import (
    BundleError,
    CheckpointVerificationError,
    NanGuardConfigError,
    NanGuardError,
    NanGuardWarning,
    NonFiniteTrainingError,
    RankDivergenceError,
    RecoveryBudgetExhausted,
    UnsupportedSetupError,
)
from lightning_nanguard.forensics.offline import BundleReplay, replay_bundle
from lightning_nanguard.preset import default_callbacks
from lightning_nanguard.reporting.incidents import Incident

__version__ = "0.1.0"

__all__ = [
    "Action",
    "AutoRollback",
    "BundleError",
    "BundleReplay",
    "CheckpointGuard",
    "CheckpointVerificationError",
    "FP32Evaluation",
    "GradNormMonitor",
    "Incident",
    "LossScaleWatchdog",
    "NanGuardConfigError",
    "NanGuardError",
    "NanGuardWarning",
    "NonFiniteTrainingError",
    "OptimizerBackoff",
    "PrecisionHeadroom",
    "RankDivergenceError",
    "RecoveryBudgetExhausted",
    "UnsupportedSetupError",
    "default_callbacks",
    "last_good_checkpoint",
    "replay_bundle",
    "verify_checkpoint",
]
