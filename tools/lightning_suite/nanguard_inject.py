"""A pytest plugin that adds nanguard's preset (``default_callbacks()``) to every ``Trainer`` a test builds.

Loaded by ``run.py`` with ``-p nanguard_inject`` when it runs Lightning's own tests: each Trainer gets the six
callbacks appended to whatever the test passed, unless it already holds a nanguard callback. Nothing else changes,
so a test that passes without the plugin and fails with it shows a difference nanguard makes.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl

from lightning_nanguard import default_callbacks
from lightning_nanguard.callbacks import (
    AutoRollback,
    CheckpointGuard,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    OptimizerBackoff,
)

_OURS = (AutoRollback, CheckpointGuard, FP32Evaluation, GradNormMonitor, LossScaleWatchdog, OptimizerBackoff)
_original_init = pl.Trainer.__init__


@functools.wraps(_original_init)
def _init_with_preset(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
    callbacks = kwargs.get("callbacks")
    if callbacks is None:
        listed: list[Any] = []
    elif isinstance(callbacks, (list, tuple)):
        listed = list(callbacks)
    else:
        listed = [callbacks]
    if not any(isinstance(c, _OURS) for c in listed):
        listed.extend(default_callbacks())
    kwargs["callbacks"] = listed
    _original_init(self, *args, **kwargs)


def pytest_configure(config: Any) -> None:
    pl.Trainer.__init__ = _init_with_preset  # type: ignore[method-assign]
    # Lightning's `lightning.pytorch.trainer.trainer.Trainer` is the same class object: one assignment covers both.
