"""Which callback runs under which strategy: the table in docs/SHARDED.md, held by test."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

from lightning_nanguard import FP32Evaluation
from lightning_nanguard.callbacks._common import check_strategy_supported
from lightning_nanguard.callbacks._common import fp32_evaluation_sharded_refusal as _sharded_refusal
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.preset import CALLBACKS

pytestmark = pytest.mark.distributed

# FP32Evaluation: mode="always" under bf16-mixed; it refuses its other combinations at its own setup (below).
TESTED_UNDER_FSDP2 = {
    "GradNormMonitor",
    "AutoRollback",
    "OptimizerBackoff",
    "LossScaleWatchdog",
    "CheckpointGuard",
    "FP32Evaluation",
}


def _trainer_with(strategy_name: str) -> SimpleNamespace:
    """A stand-in Trainer whose strategy's class has ``strategy_name`` (DeepSpeed and XLA cannot be built on this
    CPU-only machine; the check reads only the class names)."""
    strategy_cls = type(strategy_name, (), {})
    return SimpleNamespace(strategy=strategy_cls())


@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_model_parallel_is_allowed_exactly_where_tested(callback: type) -> None:
    trainer = _trainer_with("ModelParallelStrategy")
    if callback.__name__ in TESTED_UNDER_FSDP2:
        check_strategy_supported(trainer, callback.__name__)  # type: ignore[arg-type]
    else:
        with pytest.raises(UnsupportedSetupError, match=rf"{callback.__name__} does not support ModelParallelStrategy"):
            check_strategy_supported(trainer, callback.__name__)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [
        ("XLAStrategy", "XLA tensors are lazy"),
    ],
)
@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_untested_strategies_are_refused_with_their_reason(callback: type, strategy: str, reason: str) -> None:
    with pytest.raises(UnsupportedSetupError, match=rf"{callback.__name__} does not support {strategy}: .*{reason}"):
        check_strategy_supported(_trainer_with(strategy), callback.__name__)  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["SingleDeviceStrategy", "DDPStrategy"])
@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_single_device_and_ddp_are_allowed(callback: type, strategy: str) -> None:
    check_strategy_supported(_trainer_with(strategy), callback.__name__)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "precision", "reason"),
    [
        ({"mode": "on_nonfinite"}, "bf16-mixed", "re-runs a batch in float32 on the rank that saw it.*a hang"),
        ({"mode": "always"}, "bf16-true", "bypass FSDP2's all-gather"),
        ({"mode": "on_nonfinite"}, "16-true", "re-runs a batch in float32 on the rank that saw it"),
        ({"mode": "always", "promote_after": 2}, "bf16-mixed", "promote_after .* is not tested under FSDP2"),
    ],
)
def test_fp32_evaluation_refuses_what_would_hang_or_bypass_fsdp2(
    kwargs: dict[str, Any], precision: str, reason: str
) -> None:
    plugin = MixedPrecision(precision, "cpu") if precision.endswith("mixed") else HalfPrecision(precision)  # type: ignore[arg-type]
    trainer = _trainer_with("ModelParallelStrategy")
    trainer.precision_plugin, trainer.precision = plugin, precision
    with pytest.raises(
        UnsupportedSetupError, match=rf"FP32Evaluation\(mode=.*does not support ModelParallelStrategy.*{reason}"
    ):
        FP32Evaluation(**kwargs).setup(trainer, None, "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(("mode", "promote_after"), [("always", 2), ("on_nonfinite", 2)])
def test_fp32_evaluation_is_a_no_op_and_allowed_under_fsdp2_in_full_precision(mode: str, promote_after: int) -> None:
    # Under 32-true FP32Evaluation does nothing (no re-run, no promotion), so the preset's configuration is allowed.
    assert _sharded_refusal(mode, "none", promote_after) == ""
    assert _sharded_refusal(mode, "mixed", promote_after) != ""  # the same arguments under bf16-mixed: refused


# test_fsdp1.py; CheckpointGuard with state_dict_type="sharded" only.
TESTED_UNDER_FSDP1 = {"GradNormMonitor", "AutoRollback", "OptimizerBackoff", "LossScaleWatchdog", "CheckpointGuard"}


def _fsdp1_trainer(
    use_orig_params: bool | None = True, precision: str = "32-true", state_dict_type: str = "sharded"
) -> SimpleNamespace:
    """A stand-in Trainer with an ``FSDPStrategy``-named strategy: its ``kwargs`` (Lightning's FSDPStrategy sets
    ``use_orig_params=True`` there unless told otherwise), its ``state_dict_type`` and the Trainer's precision are
    all the check reads."""
    kwargs = {} if use_orig_params is None else {"use_orig_params": use_orig_params}
    strategy_cls = type("FSDPStrategy", (), {"setup": lambda self, trainer: None})
    strategy = strategy_cls()
    strategy.kwargs, strategy.model, strategy.world_size = kwargs, None, 2
    strategy._state_dict_type = state_dict_type
    return SimpleNamespace(strategy=strategy, precision=precision)


@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_fsdp1_with_orig_params_is_allowed_exactly_where_tested(callback: type) -> None:
    for precision in ("32-true", "bf16-mixed"):
        trainer = _fsdp1_trainer(precision=precision)
        name = callback.__name__
        if name in TESTED_UNDER_FSDP1:
            check_strategy_supported(trainer, name)  # type: ignore[arg-type]
            # The shares are written on the parameters once the strategy has wrapped the model in its setup.
            assert type(trainer.strategy.__dict__["setup"]).__name__ == "_MarkAfterSetup"
        else:
            with pytest.raises(UnsupportedSetupError, match=rf"{name} does not support FSDPStrategy: .*param_dtype"):
                check_strategy_supported(trainer, name)  # type: ignore[arg-type]


def test_checkpoint_guard_refuses_fsdp1_full_state_dicts() -> None:
    with pytest.raises(
        UnsupportedSetupError, match=r"CheckpointGuard does not support FSDPStrategy: .*state_dict_type='sharded'"
    ):
        check_strategy_supported(_fsdp1_trainer(state_dict_type="full"), "CheckpointGuard")  # type: ignore[arg-type]
    check_strategy_supported(_fsdp1_trainer(state_dict_type="full"), "GradNormMonitor")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("use_orig_params", "precision", "reason"),
    [
        (False, "32-true", r"use_orig_params=False\): it hands the optimizer FlatParameters.*use_orig_params=True"),
        (None, "32-true", r"use_orig_params=False"),  # not Lightning's FSDPStrategy: nothing says True
        (True, "16-mixed", r"ShardedGradScaler"),
        (True, "bf16-true", r"precision='bf16-true' is not tested"),
    ],
)
@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_fsdp1_flat_parameters_and_untested_precisions_are_refused_by_every_callback(
    callback: type, use_orig_params: bool | None, precision: str, reason: str
) -> None:
    trainer = _fsdp1_trainer(use_orig_params, precision)
    with pytest.raises(UnsupportedSetupError, match=rf"{callback.__name__} does not support FSDPStrategy: .*{reason}"):
        check_strategy_supported(trainer, callback.__name__)  # type: ignore[arg-type]
    assert "setup" not in trainer.strategy.__dict__  # nothing installed on a refusal
