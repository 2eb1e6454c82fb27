"""Every metric key nanguard writes starts with ``nanguard/``; this is the one place that spells them."""

from __future__ import annotations

__all__ = [
    "GRAD_NORM",
    "GRAD_NORM_CLIPPED",
    "LAYER_GRAD_NORM",
    "LOSS_SCALE",
    "NONFINITE_GRADS",
    "OVERFLOW_RATE",
    "OVERFLOW_STEPS",
    "OVERFLOW_STREAK",
    "PREFIX",
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
LOSS_SCALE = key("loss_scale")
OVERFLOW_STEPS = key("overflow_steps")
OVERFLOW_RATE = key("overflow_rate")
OVERFLOW_STREAK = key("overflow_streak")
