"""One configuration type per callback: each callback's arguments declared once (default, rule, documentation),
validated once at construction, and read from there by the callback and the engine. The docs site's argument
tables are generated from these declarations (tools/docs_site.py)."""

from lightning_nanguard.config._declare import CallbackConfig, Configured, argument_rows, arguments_from
from lightning_nanguard.config.grad_norm_monitor import GradNormMonitorConfig
from lightning_nanguard.config.precision import CheckpointGuardConfig, FP32EvaluationConfig, PrecisionHeadroomConfig
from lightning_nanguard.config.recovery import AutoRollbackConfig, LossScaleWatchdogConfig, OptimizerBackoffConfig

__all__ = [
    "CONFIGS",
    "AutoRollbackConfig",
    "CallbackConfig",
    "CheckpointGuardConfig",
    "Configured",
    "FP32EvaluationConfig",
    "GradNormMonitorConfig",
    "LossScaleWatchdogConfig",
    "OptimizerBackoffConfig",
    "PrecisionHeadroomConfig",
    "argument_rows",
    "arguments_from",
]

# Each callback's configuration type, by the callback's name.
CONFIGS: dict[str, type[CallbackConfig]] = {
    c.kind: c
    for c in (
        GradNormMonitorConfig,
        AutoRollbackConfig,
        OptimizerBackoffConfig,
        LossScaleWatchdogConfig,
        CheckpointGuardConfig,
        FP32EvaluationConfig,
        PrecisionHeadroomConfig,
    )
}
