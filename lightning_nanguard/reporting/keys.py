"""Every metric key nanguard writes starts with ``nanguard/``; this is the one place that spells them."""

from __future__ import annotations

__all__ = [
    "EVAL_FP32_RERUNS",
    "GRAD_NORM",
    "GRAD_NORM_CLIPPED",
    "LAYER_GRAD_NORM",
    "NONFINITE_GRADS",
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
EVAL_FP32_RERUNS = key("eval", "fp32_reruns")
