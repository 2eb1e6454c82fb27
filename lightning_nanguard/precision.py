"""The Trainer's precision, classified once: one typed answer for every part that asks "is this half precision?".

Two facts are read, and they differ on purpose:

* the **name** Lightning gives the precision (``"16-mixed"``, ``"bf16-true"``, ``"32-true"``, ...): ``half`` says
  whether the run computes in float16/bfloat16 at all, whatever plugin does it (Lightning's own, FSDP's, DeepSpeed's);
* the **plugin** that does it: Lightning's ``MixedPrecision`` (autocast over float32 weights: ``mixed``) or
  ``HalfPrecision`` (the weights themselves are half: ``true_half``). Only these two are switched by nanguard
  (autocast off for an evaluation step, float32 copies of half weights, a module promoted to float32); a strategy's
  own plugin (FSDP, DeepSpeed) is ``half`` but neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

__all__ = ["FULL_PRECISION", "Precision", "classify_precision"]


@dataclass(frozen=True)
class Precision:
    """How a Trainer computes.

    Attributes:
        name: the precision as Lightning names it (``"16-mixed"``, ``"bf16-true"``, ``"32-true"``, ...).
        half: it computes in float16 or bfloat16 (the name says so, whichever plugin does it).
        mixed: Lightning's ``MixedPrecision`` plugin: autocast over float32 weights.
        true_half: Lightning's ``HalfPrecision`` plugin: the parameters themselves are float16/bfloat16.
        dtype: the half dtype (``torch.bfloat16`` for ``bf16-*``, else ``torch.float16``); ``torch.float32`` when
            not ``half``.
    """

    name: str
    half: bool
    mixed: bool
    true_half: bool
    dtype: torch.dtype

    @property
    def kind(self) -> Literal["mixed", "true", "none"]:
        """What nanguard can switch to float32: autocast (``"mixed"``), half weights (``"true"``), or nothing."""
        if self.mixed:
            return "mixed"
        return "true" if self.true_half else "none"

    @property
    def dtype_name(self) -> str:
        """``"float16"``, ``"bfloat16"`` or ``"float32"``: the dtype as a message names it."""
        return str(self.dtype).removeprefix("torch.")


def classify_precision(trainer: pl.Trainer) -> Precision:
    """The Trainer's ``Precision``, read from its precision plugin (no tensor is touched)."""
    plugin = trainer.precision_plugin
    name = str(getattr(plugin, "precision", "32-true"))
    half = name.startswith(("16", "bf16"))
    dtype = (torch.bfloat16 if name.startswith("bf16") else torch.float16) if half else torch.float32
    return Precision(
        name=name,
        half=half,
        mixed=isinstance(plugin, MixedPrecision),
        true_half=isinstance(plugin, HalfPrecision),
        dtype=dtype,
    )


# What a Trainer without a half-precision plugin computes in (the default before ``classify_precision`` has run).
FULL_PRECISION = Precision("32-true", half=False, mixed=False, true_half=False, dtype=torch.float32)
