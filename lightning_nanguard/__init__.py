"""lightning_nanguard: composable PyTorch Lightning callbacks that keep training numerically healthy.

Every public name is imported on first use (PEP 562), so that ``import lightning_nanguard`` (and the ``nanguard``
command's ``--version``, ``report`` and ``verify``) does not pay for importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
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
    from lightning_nanguard.forensics.offline import BundleReplay, replay_bundle
    from lightning_nanguard.preset import default_callbacks
    from lightning_nanguard.reporting.incidents import Incident

__version__ = "0.1.1"

# The module each lazily imported name lives in (the imports above, for type checkers and readers).
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "AutoRollback",
            "CheckpointGuard",
            "FP32Evaluation",
            "GradNormMonitor",
            "LossScaleWatchdog",
            "OptimizerBackoff",
            "PrecisionHeadroom",
        ),
        "lightning_nanguard.callbacks",
    ),
    "last_good_checkpoint": "lightning_nanguard.checkpointing.verify",
    "verify_checkpoint": "lightning_nanguard.checkpointing.verify",
    "Action": "lightning_nanguard.contract",
    "BundleReplay": "lightning_nanguard.forensics.offline",
    "replay_bundle": "lightning_nanguard.forensics.offline",
    "default_callbacks": "lightning_nanguard.preset",
    "Incident": "lightning_nanguard.reporting.incidents",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # a subpackage (``lightning_nanguard.callbacks``), as an eager import would have set it
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once: the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
