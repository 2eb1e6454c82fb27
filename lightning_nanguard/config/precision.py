"""The arguments of the callbacks about precision and checkpoints: CheckpointGuard, FP32Evaluation,
PrecisionHeadroom."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from lightning_nanguard.config._declare import CallbackConfig, Choice, Flag, Float, Int, arg

__all__ = ["CheckpointGuardConfig", "FP32EvaluationConfig", "PrecisionHeadroomConfig"]

_STRICT_BOOL = Flag(strict=True)  # 0/1 compare equal to False/True but are not what a YAML bool reads as


@dataclass(frozen=True)
class CheckpointGuardConfig(CallbackConfig):
    """CheckpointGuard's arguments: what a load requires, and what a failed verification does."""

    kind: ClassVar[str] = "CheckpointGuard"

    require_sidecar: bool = arg(
        True,
        _STRICT_BOOL,
        """Refuse to load a file without its `.checksum` sidecar (written by CheckpointGuard or by
        `nanguard verify --write-sidecar`). `False` (the preset's) checks such files for zip CRC-32s, readability
        and finiteness only.""",
    )
    fallback: bool = arg(
        False,
        _STRICT_BOOL,
        """On a failed verification, resume from the verified checkpoint of the same directory nearest to the
        requested file's step and not after it.""",
    )
    tag_last_good: bool = arg(
        True,
        _STRICT_BOOL,
        "Keep `nanguard-last-good.ckpt` pointing at the newest good checkpoint of each directory.",
    )


@dataclass(frozen=True)
class FP32EvaluationConfig(CallbackConfig):
    """FP32Evaluation's arguments: which evaluation steps run in float32, and when a training module is promoted."""

    kind: ClassVar[str] = "FP32Evaluation"

    mode: Literal["always", "on_nonfinite"] = arg(
        "always",
        Choice(("always", "on_nonfinite")),
        """`"always"` runs every validation and test step in float32; `"on_nonfinite"` re-runs only the non-finite
        batches in float32.""",
    )
    promote_after: int | None = arg(
        None,
        Int(minimum=1, allow_none=True),
        "Half-precision overflows attributed to one training module before it runs in float32; `None`: never.",
    )


@dataclass(frozen=True)
class PrecisionHeadroomConfig(CallbackConfig):
    """PrecisionHeadroom's arguments: how often headroom is sampled, when a module is promoted or demoted, and the
    loss-scaled gradient's margin."""

    kind: ClassVar[str] = "PrecisionHeadroom"

    every_n_steps: int = arg(50, Int(minimum=1), "Optimizer steps between two samples (sooner near the limit).")
    margin_bits: float = arg(
        1.0, Float(low=0.0, high=10.0), "Headroom, in bits, below which a module is promoted at once."
    )
    horizon_steps: int = arg(
        200,
        Int(minimum=1),
        "A module whose falling trend reaches 0 bits within this many steps is promoted.",
    )
    demote_after: int | None = arg(
        20,
        Int(minimum=1, allow_none=True),
        "Samples of recovered headroom before a promoted module goes back (`None`: never).",
    )
    promote: bool = arg(
        True,
        Flag(strict=True, message="must be True or False"),
        "`False` reports only (no module is moved to float32).",
    )
    scale_margin_bits: float | None = arg(
        4.0,
        Float(low=0.0, high=15.0, allow_none=True),
        """Under `16-mixed`, the float16 headroom, in bits, the loss-scaled parameter gradients keep: below it the
        GradScaler's scale is lowered by a power of two before the next step (never raised; never below
        LossScaleWatchdog's `min_scale`). `None`: the scale is left to the GradScaler.""",
    )
