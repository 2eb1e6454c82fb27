"""The configurations a demo compares: none, the preset, each callback alone."""

from __future__ import annotations

import functools
from collections.abc import Callable

from lightning.pytorch.callbacks import Callback

from lightning_nanguard.preset import CALLBACKS, default_callbacks

__all__ = ["CONFIGS", "preset"]


def preset() -> list[Callback]:
    """The six callbacks at cooperative defaults: ``lightning_nanguard.default_callbacks()``."""
    return list(default_callbacks())


def _alone(cls: type[Callback]) -> list[Callback]:
    return [cls()]


# name -> callbacks factory (a fresh list per run: callbacks hold per-fit state). Each callback alone runs at its
# constructor's defaults.
CONFIGS: dict[str, Callable[[], list[Callback]]] = {
    "unguarded": list,
    "preset": preset,
    **{cls.__name__: functools.partial(_alone, cls) for cls in CALLBACKS},
}
