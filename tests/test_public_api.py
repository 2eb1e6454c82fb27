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


def test_the_package_imports_its_names_on_first_use() -> None:
    """``import lightning_nanguard`` imports no Lightning (the names come on first use, the ``nanguard`` command
    starts fast), and every name and subpackage reads as an eager import would have made it."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = (
        "import sys, lightning_nanguard as ng\n"
        "assert 'lightning' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "assert ng.callbacks.GradNormMonitor is ng.GradNormMonitor\n"
        "assert ng.contract.Action is ng.Action and ng.testing.FaultInjector\n"
        "assert not hasattr(ng, 'no_such_name')\n"
        "assert set(ng.__all__) <= set(dir(ng))\n"
    )
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", probe], cwd=os.path.dirname(root), env=env, check=True, timeout=120)
