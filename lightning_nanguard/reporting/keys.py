"""Every metric key nanguard writes starts with ``nanguard/``; this is the one place that spells them."""

from __future__ import annotations

__all__ = [
    "EPS",
    "EVAL_FP32_RERUNS",
    "GRAD_NORM",
    "GRAD_NORM_CLIPPED",
    "GRAD_NORM_HIST",
    "GRAD_NORM_MAX",
    "HEADROOM",
    "HEADROOM_MIN",
    "HEADROOM_SCALED_GRAD",
    "LAYER_GRAD_NORM",
    "LOSS",
    "LOSS_SCALE",
    "LOSS_SCALE_LOWERED",
    "LR_SCALE",
    "NONFINITE_STEPS",
    "OVERFLOW_RATE",
    "OVERFLOW_STEPS",
    "OVERFLOW_STREAK",
    "PREFIX",
    "PROMOTED_MODULES",
    "QUARANTINED",
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
GRAD_NORM_MAX = key("grad_norm_max")
GRAD_NORM_CLIPPED = key("grad_norm_clipped")
GRAD_NORM_HIST = key("grad_norm_hist")
NONFINITE_STEPS = key("nonfinite_steps")
LOSS = key("loss")
SKIPPED_STEPS = key("skipped_steps")
QUARANTINED = key("quarantined")
LAYER_GRAD_NORM = key("layer_grad_norm")  # + "/<module path>"
LR_SCALE = key("lr_scale")
EPS = key("eps")  # or + "/opt{i}_group{j}" when groups differ
ROLLBACKS = key("rollbacks")
ROLLBACK_SKIPPED_BATCHES = key("rollback_skipped_batches")
LOSS_SCALE = key("loss_scale")
OVERFLOW_STEPS = key("overflow_steps")
OVERFLOW_RATE = key("overflow_rate")
OVERFLOW_STREAK = key("overflow_streak")
EVAL_FP32_RERUNS = key("eval", "fp32_reruns")
HEADROOM = key("headroom")  # + "/<module path>": bits left before the output overflows the training precision
HEADROOM_MIN = key("headroom_min")
PROMOTED_MODULES = key("promoted_modules")
HEADROOM_SCALED_GRAD = key("headroom_scaled_grad")  # 16-mixed: the largest gradient x the loss scale, in bits
LOSS_SCALE_LOWERED = key("loss_scale_lowered")  # 16-mixed: times PrecisionHeadroom lowered the scale
