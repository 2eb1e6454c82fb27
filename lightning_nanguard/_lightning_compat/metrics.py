"""torchmetrics ``Metric`` states, saved before a call and put back after it.

An evaluation step that is run twice (``FP32Evaluation(mode="on_nonfinite")`` re-runs a batch that came out
non-finite in half precision) updates the module's metrics twice. Putting their states back before the re-run leaves
them as one call would. A metric's states are the attributes named in ``Metric._defaults`` (tensors, or lists of
tensors for ``cat`` states) plus its update count and cached results; torchmetrics has no public way to set them
without a copy of the whole state dict.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torchmetrics import Metric

__all__ = ["MetricStates"]

# One metric's saved state: the metric, (name, object, copy) per state, update count, computed and forward caches.
_Saved = tuple["Metric", list[tuple[str, Any, Any]], int, Any, Any]


class MetricStates:
    """The ``torchmetrics.Metric`` modules inside ``module`` (a ``MetricCollection``'s included), found once.

    ``save`` copies their states (one tensor copy per tensor state, no host read); ``restore`` puts the saved values
    back into the same objects, so references a ``MetricCollection`` shares between the metrics of a compute group
    stay shared. Metrics held outside the module tree (in a plain ``list`` or ``dict`` attribute) are not found.
    """

    def __init__(self, module: nn.Module) -> None:
        # A Metric exists only once torchmetrics is imported: looked up there, not imported (``nanguard verify`` and
        # the other imports of this package that need no metric then do not pay for it).
        metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
        self.metrics: list[Metric] = [] if metric is None else [m for m in module.modules() if isinstance(m, metric)]

    def __bool__(self) -> bool:
        return bool(self.metrics)

    def save(self) -> list[_Saved]:
        saved = []
        with torch.no_grad():
            for metric in self.metrics:
                states = []
                for name in metric._defaults:
                    value = getattr(metric, name)
                    copy = (
                        value.clone()
                        if isinstance(value, Tensor)
                        else list(value)
                        if isinstance(value, list)
                        else value
                    )
                    states.append((name, value, copy))
                saved.append((metric, states, metric._update_count, metric._computed, metric._forward_cache))
        return saved

    @staticmethod
    def restore(saved: list[_Saved]) -> None:
        with torch.no_grad():
            for metric, states, update_count, computed, forward_cache in saved:
                for name, value, copy in states:
                    if isinstance(value, Tensor) and value.shape == copy.shape:
                        value.copy_(copy)  # the same object: a compute group's shared references stay shared
                    elif isinstance(value, list):
                        value[:] = copy
                    else:
                        value = copy
                    setattr(metric, name, value)
                metric._update_count = update_count
                metric._computed = computed
                metric._forward_cache = forward_cache
