"""One classifier of the Trainer's precision: its name, and which Lightning plugin computes in half precision."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)

from lightning_nanguard.precision import FULL_PRECISION, classify_precision


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (Precision(), ("32-true", False, "none", torch.float32)),
        (DoublePrecision(), ("64-true", False, "none", torch.float32)),
        (
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")),
            ("16-mixed", True, "mixed", torch.float16),
        ),
        (MixedPrecision("bf16-mixed", "cpu"), ("bf16-mixed", True, "mixed", torch.bfloat16)),
        (HalfPrecision("16-true"), ("16-true", True, "true", torch.float16)),
        (HalfPrecision("bf16-true"), ("bf16-true", True, "true", torch.bfloat16)),
        # A strategy's own plugin computes in half precision, but nanguard switches neither its autocast nor weights.
        (FSDPPrecision("bf16-mixed"), ("bf16-mixed", True, "none", torch.bfloat16)),
        (DeepSpeedPrecision("16-mixed"), ("16-mixed", True, "none", torch.float16)),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, tuple) else v[0],
)
def test_each_plugin_is_classified_by_its_name_and_its_kind(plugin: Precision, expected: tuple[object, ...]) -> None:
    found = classify_precision(SimpleNamespace(precision_plugin=plugin))  # type: ignore[arg-type]
    assert (found.name, found.half, found.kind, found.dtype) == expected
    assert found.mixed == isinstance(plugin, MixedPrecision)
    assert found.true_half == isinstance(plugin, HalfPrecision)
    assert found.dtype_name == str(expected[3]).removeprefix("torch.")


def test_the_default_is_full_precision() -> None:
    assert classify_precision(SimpleNamespace(precision_plugin=Precision())) == FULL_PRECISION  # type: ignore[arg-type]
