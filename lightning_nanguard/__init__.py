"""lightning_nanguard: composable PyTorch Lightning callbacks that keep training numerically healthy."""

from lightning_nanguard.callbacks import FP32Evaluation, GradNormMonitor
from lightning_nanguard.exceptions import (
    CheckpointVerificationError,
    NanGuardConfigError,
    NanGuardError,
    NonFiniteTrainingError,
    RecoveryBudgetExhausted,
    UnsupportedSetupError,
)
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.reporting.incidents import Incident

__version__ = "0.1.0.dev0"

__all__ = [
    "Action",
    "CheckpointVerificationError",
    "FP32Evaluation",
    "GradNormMonitor",
    "Incident",
    "NanGuardConfigError",
    "NanGuardError",
    "NonFiniteTrainingError",
    "RecoveryBudgetExhausted",
    "UnsupportedSetupError",
]
