"""The public surface is deliberate: this test pins it."""

from __future__ import annotations

import lightning_nanguard

EXPECTED = {
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
}


def test_all_is_pinned() -> None:
    assert set(lightning_nanguard.__all__) == EXPECTED


def test_every_name_in_all_exists() -> None:
    for name in lightning_nanguard.__all__:
        assert getattr(lightning_nanguard, name) is not None


def test_error_hierarchy() -> None:
    from lightning_nanguard import exceptions as e

    assert issubclass(e.RecoveryBudgetExhausted, e.NonFiniteTrainingError)
    assert issubclass(e.RankDivergenceError, e.NanGuardError)
    assert issubclass(e.NonFiniteTrainingError, e.NanGuardError)
    assert issubclass(e.NanGuardError, RuntimeError)
    assert issubclass(e.BundleError, e.NanGuardError)
    assert issubclass(e.NanGuardConfigError, ValueError)
