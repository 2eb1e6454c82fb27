"""LossScaleWatchdog and GradNormMonitor under ``DeepSpeedStrategy``: what they do there, and what they refuse.

DeepSpeed's engine owns the optimizer step, so both read its outcome after ``engine.step()``
(``parts/deepspeed_sensing.py``):

* **LossScaleWatchdog** logs DeepSpeed's fp16 scale and its overflow skips under the usual ``nanguard/...`` keys,
  holds the scale in ``[min_scale, max_scale]`` after every step (a Python float: no device work), and takes the
  collapse decision over from DeepSpeed: with a collapse rule set it clears ZeRO's ``raise_error_at_min_scale``, so
  a persistent overflow ends in a nanguard incident and a stop (or a warning) that explains it, instead of
  DeepSpeed's bare "Current loss scale already at minimum ... Exiting run."; without a rule, that exit is explained
  where it happens (``on_exception``). A rollback is not available: AutoRollback does not support DeepSpeed.
* **GradNormMonitor** logs the engine's global grad norm and counts the steps DeepSpeed dropped because its own
  overflow check found inf/NaN gradients: always under fp16; under bf16 with ZeRO stage 1 or 2 the monitor turns
  that check on (``"bf16": {"check_grad_overflow": true}``), so DeepSpeed drops such an update itself. Nanguard
  cannot drop one: the update happens inside ``engine.step()``, after the last hook. Where DeepSpeed has no check
  (bf16/fp32 under ZeRO-3 or no ZeRO, fp32 under ZeRO-1/2) a non-finite step would go unseen, since ZeRO reports an
  inf/NaN norm as -1 per group, so the monitor refuses those setups (``require_overflow_check``). Under DeepSpeed
  ``on_nonfinite`` is therefore always a drop (by DeepSpeed), and spikes, per-layer norms, forensics and quarantine,
  which need the gradients before the update, are not available.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_nanguard import _lightning_compat, _notices
from lightning_nanguard.engine import Engine
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.parts.deepspeed_sensing import (
    DeepSpeedGradWatch,
    DeepSpeedScaleWatch,
    ScaleSettings,
    step_reader,
)
from lightning_nanguard.policies.loss_scale import CollapsePolicy
from lightning_nanguard.signals.loss_scale import ScaleHistory

__all__ = ["install_grad_watch", "install_scale_watch", "is_deepspeed", "require_overflow_check"]


def is_deepspeed(trainer: pl.Trainer) -> bool:
    return "DeepSpeedStrategy" in _lightning_compat.strategy_class_names(trainer)


def require_overflow_check(trainer: pl.Trainer) -> bool:
    """Make sure DeepSpeed checks every step's gradients for inf/NaN (and drops such an update itself); True when
    nanguard turned the check on. Raises ``UnsupportedSetupError`` where DeepSpeed has no such check.

    fp16 (any ZeRO stage, or none) always checks. bf16 under ZeRO stage 1 or 2 checks with the config's
    ``"bf16": {"check_grad_overflow": true}``, which is set here, before DeepSpeed reads the config (the callbacks'
    setup runs before the strategy's). Elsewhere (bf16 or fp32 under ZeRO-3 or no ZeRO; fp32 under ZeRO-1/2)
    DeepSpeed does not check, and its grad norm does not show a non-finite step either: ZeRO replaces an inf/NaN
    norm by -1 per parameter group (``mask_nan_or_inf_with_val_inplace``), so a NaN step reads as a norm of 1.0.
    """
    precision = str(trainer.precision)
    if precision in ("16-mixed", "16-true"):
        return False
    config = getattr(trainer.strategy, "config", None)
    config = config if isinstance(config, dict) else {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if precision in ("bf16-mixed", "bf16-true") and stage in (1, 2):
        bf16 = config.setdefault("bf16", {"enabled": True})
        if bf16.get("check_grad_overflow") is False:
            raise UnsupportedSetupError(
                'GradNormMonitor does not support DeepSpeedStrategy with "bf16": {"check_grad_overflow": false}: '
                "without DeepSpeed's check nothing sees or drops a non-finite bf16 step (see below). Remove that "
                "setting (GradNormMonitor turns the check on), or the callback."
            )
        forced = "check_grad_overflow" not in bf16
        bf16["check_grad_overflow"] = True
        return forced
    raise UnsupportedSetupError(
        f"GradNormMonitor does not support DeepSpeedStrategy under precision={precision!r} with ZeRO stage {stage}: "
        "there DeepSpeed neither checks the gradients for inf/NaN (it does under fp16, and under bf16 with ZeRO "
        "stage 1 or 2 with check_grad_overflow) nor reports a non-finite grad norm (ZeRO replaces an inf/NaN norm "
        "by -1 per parameter group; without ZeRO no norm is computed), and the update happens inside "
        "engine.step(), after the last hook: nanguard could neither see nor drop a non-finite step. Use "
        "precision='16-mixed', or bf16 with ZeRO stage 1 or 2, or remove the callback."
    )


def install_grad_watch(
    trainer: pl.Trainer,
    engine: Engine,
    *,
    spike_zscore: float | None,
    max_consecutive_skips: int,
    skipped_before: int,
) -> None:
    """GradNormMonitor's ``_install`` under DeepSpeed: read the engine's norm and overflow flag after each step."""
    if spike_zscore is not None:
        raise UnsupportedSetupError(
            "GradNormMonitor(spike_zscore=...) does not support DeepSpeedStrategy: a spike is judged before the "
            "update, and DeepSpeed's grad norm exists only after engine.step() has applied it. Remove spike_zscore, "
            "or the callback."
        )
    forced_check = require_overflow_check(trainer)
    reader = step_reader(engine)
    watch = DeepSpeedGradWatch(
        engine,
        reader,
        max_consecutive_skips=max_consecutive_skips,
        skipped_before=skipped_before,
        forced_check=forced_check,
    )
    reader.subscribe("GradNormMonitor", watch.on_step)
    engine.add_metrics(watch.metrics)
    _notices.note(
        "GradNormMonitor under DeepSpeed: logs DeepSpeed's global grad norm and counts its overflow skips; per-layer "
        "norms, forensics and quarantine need the gradients before the update and are off."
    )


def install_scale_watch(
    engine: Engine, settings: ScaleSettings, policy: CollapsePolicy, history: ScaleHistory
) -> DeepSpeedScaleWatch:
    """LossScaleWatchdog's ``_install`` under DeepSpeed: watch its loss scaler after each step (the scaler exists
    from train start, ``DeepSpeedScaleWatch.train_start``)."""
    watch = DeepSpeedScaleWatch(settings, policy, history, engine)
    step_reader(engine).subscribe("LossScaleWatchdog", watch.on_step)
    engine.add_metrics(watch.metrics)
    return watch
