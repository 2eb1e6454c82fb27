"""Learning-rate and epsilon backoff arithmetic that survives every torch scheduler, rollbacks and checkpoints.

Multiplying ``group["lr"]`` alone is undone by the next scheduler step for every closed-form scheduler (LambdaLR,
OneCycleLR, CyclicLR, CosineAnnealingWarmRestarts, and CosineAnnealingLR at its restart branch): they recompute the
rate from anchors (``base_lrs``, ``group["initial_lr"|"max_lr"|"min_lr"]``, ``max_lrs``, ``eta_min``). Scaling the
rate *and* every anchor by the same factor makes the backed-off schedule exactly ``factor`` times the original one,
for chainable and closed-form schedulers alike, and composite schedulers (SequentialLR, ChainedScheduler) are
handled by recursing into their children.

Each scaled object remembers the scale baked into it (``group["nanguard_lr_scale"]`` in every param group and a
``nanguard_lr_scale`` attribute on every scheduler). Both travel with ``state_dict()``: param-group keys are saved
with the optimizer and a scheduler's state is its ``__dict__``. So after anything restores an older state (a rollback,
``fit(ckpt_path=...)``), ``sync_lr_scale`` brings each object to the wanted scale by its *own* recorded scale, once:
it is idempotent, and it is right even when the optimizer was restored and the scheduler was not.

No Lightning here: optimizers and schedulers in, scaled in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.swa_utils import SWALR

from lightning_nanguard import _lightning_compat

__all__ = [
    "EPS_SCALE_KEY",
    "LR_SCALE_KEY",
    "eps_groups",
    "eps_metrics",
    "has_eps",
    "iter_schedulers",
    "lr_scale_of",
    "scale_eps",
    "scale_schedule",
    "schedulers_of",
    "stamp_lr_scale",
    "sync_eps_scale",
    "sync_lr_scale",
]

LR_SCALE_KEY = "nanguard_lr_scale"
EPS_SCALE_KEY = "nanguard_eps_scale"

# Rate anchors some schedulers keep in the param group itself (OneCycleLR writes all three, every LRScheduler
# writes ``initial_lr``) and the ones they keep on the scheduler object.
_GROUP_ANCHORS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_LISTS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
_SCHEDULER_SCALARS = ("eta_min",)


def _mul(value: object, factor: float) -> object:
    if isinstance(value, Tensor):
        return value.mul_(factor)  # in place: a tensor lr may be captured by a fused/capturable optimizer
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) * factor
    return value


def iter_schedulers(schedulers: Iterable[object]) -> Iterator[object]:
    """Every scheduler object, composites (``_schedulers``) expanded depth first, each object once."""
    seen: set[int] = set()
    stack = list(schedulers)[::-1]
    while stack:
        s = stack.pop()
        if s is None or id(s) in seen:
            continue
        seen.add(id(s))
        yield s
        stack.extend(_lightning_compat.inner_schedulers(s)[::-1])


def schedulers_of(optimizer: Optimizer, schedulers: Iterable[object]) -> list[object]:
    """The schedulers (and their composite children) that drive ``optimizer``."""
    return [s for s in iter_schedulers(schedulers) if getattr(s, "optimizer", None) is optimizer]


def _scale_groups(optimizer: Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        for name in _GROUP_ANCHORS:
            if name in group:
                group[name] = _mul(group[name], factor)


def _scale_scheduler(scheduler: object, factor: float) -> None:
    if isinstance(scheduler, SWALR):
        # SWALR (StochasticWeightAveraging's scheduler) keeps its target rate in the param groups as ``swa_lr``,
        # written when it is built: it belongs to the scheduler, so it is scaled by the scheduler's own record.
        for group in scheduler.optimizer.param_groups:
            if "swa_lr" in group:
                group["swa_lr"] = _mul(group["swa_lr"], factor)
    for name in _SCHEDULER_LISTS:
        values = getattr(scheduler, name, None)
        if isinstance(values, list):
            setattr(scheduler, name, [_mul(v, factor) for v in values])
    for name in _SCHEDULER_SCALARS:
        value = getattr(scheduler, name, None)
        if value is not None:
            setattr(scheduler, name, _mul(value, factor))


def scale_schedule(optimizer: Optimizer, schedulers: Sequence[object], factor: float) -> None:
    """Multiply ``optimizer``'s learning rates and every anchor of its schedulers by ``factor``, in place.

    Call it after the scheduler stepped for the current step (Lightning: ``on_train_batch_end``). From then on the
    schedule is ``factor`` times what it would have been. Schedulers of other optimizers in ``schedulers`` are left
    alone. Recorded scales (``nanguard_lr_scale``) are multiplied too, so ``sync_lr_scale`` stays consistent.

    Raises:
        ValueError: if ``factor`` is not a positive finite number.
    """
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale_schedule(factor={factor!r}): must be a positive finite number.")
    _scale_groups(optimizer, factor)
    for group in optimizer.param_groups:
        group[LR_SCALE_KEY] = float(group.get(LR_SCALE_KEY, 1.0)) * factor
    for s in schedulers_of(optimizer, schedulers):
        _scale_scheduler(s, factor)
        setattr(s, LR_SCALE_KEY, float(getattr(s, LR_SCALE_KEY, 1.0)) * factor)


def lr_scale_of(optimizer: Optimizer) -> float:
    """The learning-rate scale baked into ``optimizer`` (its first param group's record; 1.0 when none)."""
    if not optimizer.param_groups:
        return 1.0
    return float(optimizer.param_groups[0].get(LR_SCALE_KEY, 1.0))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def stamp_lr_scale(optimizer: Optimizer, schedulers: Sequence[object]) -> None:
    """Give every param group and scheduler of ``optimizer`` an explicit scale record (1.0 where it has none).

    ``LRScheduler.load_state_dict`` is ``__dict__.update``: it cannot remove an attribute the saved state lacks. So a
    scheduler state saved *before* its first record would leave a newer record in place after a restore. Stamping
    right after the schedulers are built (``on_fit_start``) puts the record into every state saved later.
    """
    for group in optimizer.param_groups:
        group.setdefault(LR_SCALE_KEY, 1.0)
    for s in schedulers_of(optimizer, schedulers):
        if not hasattr(s, LR_SCALE_KEY):
            setattr(s, LR_SCALE_KEY, 1.0)


def sync_lr_scale(optimizer: Optimizer, schedulers: Sequence[object], scale: float) -> bool:
    """Bring every param group and scheduler of ``optimizer`` to the learning-rate ``scale``, each by its own record.

    Idempotent: objects already at ``scale`` are untouched, so calling it after every restore (or every step)
    re-applies a lost backoff exactly once. Returns True when anything changed.
    """
    stamp_lr_scale(optimizer, schedulers)
    changed = False
    for group in optimizer.param_groups:
        have = float(group.get(LR_SCALE_KEY, 1.0))
        if not _close(have, scale):
            for name in _GROUP_ANCHORS:
                if name in group:
                    group[name] = _mul(group[name], scale / have)
            group[LR_SCALE_KEY] = float(scale)
            changed = True
    for s in schedulers_of(optimizer, schedulers):
        have = float(getattr(s, LR_SCALE_KEY, 1.0))
        if not _close(have, scale):
            _scale_scheduler(s, scale / have)
            setattr(s, LR_SCALE_KEY, float(scale))
            changed = True
    return changed


def has_eps(group: dict[str, Any]) -> bool:
    """Whether a param group has a plain-number ``eps`` (Adam family, RMSprop, Adagrad, Adadelta, ...)."""
    eps = group.get("eps")
    return isinstance(eps, (int, float)) and not isinstance(eps, bool)


def eps_groups(optimizers: Sequence[Optimizer], mode: str = "always") -> list[tuple[int, int, dict[str, Any]]]:
    """``(opt_idx, group_idx, group)`` of the groups eps backoff acts on.

    ``mode="auto"``: non-fused groups holding float16 parameters, the only place eps underflows (``16-true``); under
    mixed precision the optimizer runs in float32 on float32 master weights, and bfloat16 has float32's range.
    ``"always"``: every group with an eps. ``"never"``: none.
    """
    if mode == "never":
        return []
    out = []
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            if not has_eps(group):
                continue
            if mode == "always" or (not group.get("fused") and any(p.dtype == torch.float16 for p in group["params"])):
                out.append((i, j, group))
    return out


def eps_metrics(optimizers: Sequence[Optimizer], key: str) -> dict[str, float]:
    """``{key: eps}`` when every group with an eps shares one value, else ``{key/opt{i}_group{j}: eps}``."""
    found = {f"opt{i}_group{j}": float(g["eps"]) for i, j, g in eps_groups(optimizers)}
    if not found:
        return {}
    if len(set(found.values())) == 1:
        return {key: next(iter(found.values()))}
    return {f"{key}/{name}": value for name, value in found.items()}


def scale_eps(group: dict[str, Any], factor: float, max_eps: float) -> tuple[float, float]:
    """Multiply one group's ``eps`` by ``factor``, capped at ``max_eps`` (never lowering an eps already above it).

    Adam-family optimizers read ``group["eps"]`` at every ``step()``, so the change takes effect on the next step,
    for the for-loop, foreach and fused implementations alike. Returns ``(before, after)``.
    """
    before = float(group["eps"])
    after = min(before * factor, max(max_eps, before))
    group["eps"] = after
    group[EPS_SCALE_KEY] = float(group.get(EPS_SCALE_KEY, 1.0)) * factor
    return before, after


def sync_eps_scale(group: dict[str, Any], scale: float, max_eps: float) -> tuple[float, float] | None:
    """Bring one group's ``eps`` to the backoff ``scale`` by its recorded scale (idempotent, like ``sync_lr_scale``).

    Returns ``(before, after)`` when it changed the group, ``None`` when it was already there.
    """
    have = float(group.get(EPS_SCALE_KEY, 1.0))
    if _close(have, scale):
        return None
    before = float(group["eps"])
    ratio = scale / have
    after = min(before * ratio, max(max_eps, before)) if ratio > 1 else before * ratio
    group["eps"] = after
    group[EPS_SCALE_KEY] = float(scale)
    return before, after
