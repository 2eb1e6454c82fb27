"""Every metric key nanguard writes starts with ``nanguard/``; this is the one place that spells them."""

from __future__ import annotations

__all__ = [
    "EPS",
    "EVAL_FP32_RERUNS",
    "GRAD_NORM",
    "GRAD_NORM_CLIPPED",
    "LAYER_GRAD_NORM",
    "LOSS_SCALE",
    "LR_SCALE",
    "NONFINITE_GRADS",
    "OVERFLOW_RATE",
    "OVERFLOW_STEPS",
    "OVERFLOW_STREAK",
    "PREFIX",
    "RESTORED_FROM_STEP",
    "ROLLBACKS",
    "ROLLBACK_SKIPPED_BATCHES",
    "SKIPPED_STEPS",
    "key",
]

PREFIX = "nanguard"


def key(*parts: str) -> str:
    """``key("grad_norm")`` -> ``"nanguard/grad_norm"``."""
    return "/".join((PREFIX, *parts))


GRAD_NORM = key("grad_norm")
GRAD_NORM_CLIPPED = key("grad_norm_clipped")
NONFINITE_GRADS = key("nonfinite_grads")
SKIPPED_STEPS = key("skipped_steps")
LAYER_GRAD_NORM = key("layer_grad_norm")  # + "/<module path>"
LR_SCALE = key("lr_scale")
EPS = key("eps")  # or + "/opt{i}_group{j}" when groups differ
ROLLBACKS = key("rollbacks")
RESTORED_FROM_STEP = key("restored_from_step")
ROLLBACK_SKIPPED_BATCHES = key("rollback_skipped_batches")
LOSS_SCALE = key("loss_scale")
OVERFLOW_STEPS = key("overflow_steps")
OVERFLOW_RATE = key("overflow_rate")
OVERFLOW_STREAK = key("overflow_streak")
EVAL_FP32_RERUNS = key("eval", "fp32_reruns")
