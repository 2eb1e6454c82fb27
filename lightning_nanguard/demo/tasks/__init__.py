"""The built-in demo tasks; importing this package registers them (in this order)."""

from lightning_nanguard.demo.tasks import (
    bad_data,
    bn_poison,
    bn_poison_shuffled,
    corrupt_resume,
    eps_underflow,
    eval_overflow,
    fp16_explosion,
    lr_restart,
    spike_then_diverge,
)

__all__ = [
    "bad_data",
    "bn_poison",
    "bn_poison_shuffled",
    "corrupt_resume",
    "eps_underflow",
    "eval_overflow",
    "fp16_explosion",
    "lr_restart",
    "spike_then_diverge",
]
