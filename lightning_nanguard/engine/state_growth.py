"""Finite damage: parameters grown by orders of magnitude since the last sound snapshot (incident path only).

A few finite updates at a too-high learning rate can blow the weights up by ten orders of magnitude long before a
value overflows; the non-finite value that follows then looks like anything (an ``addmm`` overflowing in the forward,
a loss of huge outputs, labels that "do not fit"). So the state is judged as well as the step: each parameter's
largest |value| now against the same in AutoRollback's newest sound snapshot (``Restorer.sound_reference``, read
from the host copy the ring keeps). Nothing is added to a healthy step or to taking a snapshot: this runs only once an
event is being diagnosed, where AutoRollback keeps snapshots in memory. ``merge`` makes the ranks' parts one verdict
(``policies.findings.Growth``), identical on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning.pytorch as pl
import torch

from lightning_nanguard.contract import Signal
from lightning_nanguard.engine.events import EventFacts
from lightning_nanguard.engine.registry import Registry
from lightning_nanguard.policies.findings import Growth

__all__ = ["FLOOR", "GROWTH_FACTOR", "LocalGrowth", "local_growth", "merge"]

GROWTH_FACTOR = 1e3  # a parameter whose largest |value| grew more than this is damaged, finite or not
FLOOR = 1.0  # ... measured against max(its value then, this): a bias grown from 0 to 0.1 is no damage

LocalGrowth = tuple[int, dict[str, tuple[float, float]]]  # (reference step, {name: (now, then)}) on one rank


@torch.no_grad()
def local_growth(registry: Registry, pl_module: pl.LightningModule, facts: EventFacts) -> LocalGrowth | None:
    """This rank's parameters' largest |value| now and at the newest sound snapshot (``None``: nothing to compare:
    no snapshot in memory, the state is already non-finite, or the event is no training step)."""
    restorer = registry.restorer
    reference = getattr(restorer, "sound_reference", None)
    if reference is None or not facts.state_ok or not facts.readings or facts.signal is Signal.DIVERGING:
        return None
    params = [
        (n, p)
        for n, p in pl_module.named_parameters()
        if type(p.data) is torch.Tensor and p.is_floating_point() and p.numel()
    ]
    if not params:
        return None
    found = reference({n for n, _ in params})
    if found is None:
        return None
    step, then = found
    params = [(n, p) for n, p in params if n in then]
    if not params:
        return step, {}
    device = params[0][1].device
    now = torch.stack([p.detach().abs().amax().float().to(device) for _, p in params]).tolist()  # one host read
    return step, {n: (float(v), then[n]) for (n, _), v in zip(params, now, strict=True)}


def merge(parts: Sequence[LocalGrowth | None]) -> Growth | None:
    """The parameters grown more than ``GROWTH_FACTOR`` on any rank (the largest values over the ranks), largest growth
    first; ``None`` when no rank compared."""
    found = [p for p in parts if p is not None]
    if not found:
        return None
    step = min(s for s, _ in found)
    best: dict[str, tuple[float, float]] = {}
    for _, values in found:
        for name, (now, then) in values.items():
            was_now, was_then = best.get(name, (0.0, 0.0))
            best[name] = (max(was_now, now), max(was_then, then))
    grown = [
        (n, now, then)
        for n, (now, then) in best.items()
        if math.isfinite(now) and now > GROWTH_FACTOR * max(then, FLOOR)
    ]
    grown.sort(key=lambda g: g[1] / max(g[2], FLOOR), reverse=True)
    return Growth(step, GROWTH_FACTOR, tuple(grown))
