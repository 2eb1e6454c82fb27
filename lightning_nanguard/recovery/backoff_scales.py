"""The scales OptimizerBackoff keeps applied: the learning-rate scale (its ``policies.backoff.BackoffPolicy``) and
the eps scale, on every optimizer and scheduler, and re-applied after anything restores an older state (the
arithmetic is ``recovery.backoff``'s). No Lightning: optimizers and schedulers in, scaled in place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_nanguard.policies.backoff import BackoffPolicy
from lightning_nanguard.policies.snapshot_rates import RestoredRates
from lightning_nanguard.recovery.backoff import (
    EPS_SCALE_KEY,
    eps_groups,
    lr_scale_of,
    stamp_lr_scale,
    sync_eps_scale,
    sync_lr_scale,
)

__all__ = ["BackoffResult", "BackoffScales"]


@dataclass(frozen=True)
class BackoffResult:
    """What one backoff did: a sentence for the learning rate and one for eps (``""`` where that part was not asked
    and did not change), and the before/after values for the incident record."""

    lr: str = ""
    eps: str = ""
    values: Mapping[str, object] = field(default_factory=dict)


class BackoffScales:
    """The current learning-rate and eps scales, and the optimizers and schedulers brought to them.

    Args:
        policy: how far the learning rate backs off and when it recovers.
        eps_mode: which param groups eps backoff acts on (``recovery.backoff.eps_groups``).
        eps_factor: eps is multiplied by this at each eps backoff.
        max_eps: eps is never raised above this.
    """

    def __init__(self, policy: BackoffPolicy, *, eps_mode: str, eps_factor: float, max_eps: float) -> None:
        self.policy = policy
        self.eps_mode = eps_mode
        self.eps_factor = eps_factor
        self.max_eps = max_eps
        self.eps_scale = 1.0
        self.extra_notches = 0  # this event's rollback passed over snapshots taken mid-divergence
        self._schedulers: tuple[int, ...] = ()  # ids of the schedulers brought to the scale last

    def stamp(self, optimizers: Sequence[Optimizer], schedulers: Sequence[object]) -> None:
        """Record scale 1.0 in every fresh optimizer and scheduler before anyone snapshots them: a scheduler restore
        is ``__dict__.update`` and cannot drop a record its saved state lacks (``stamp_lr_scale``)."""
        for opt in optimizers:
            stamp_lr_scale(opt, schedulers)

    def new_schedulers(self, schedulers: Sequence[object]) -> bool:
        """A scheduler was built since the last ``sync`` (StochasticWeightAveraging's SWALR, mid-fit): it starts at
        the configured scale."""
        return tuple(id(s) for s in schedulers) != self._schedulers

    def adopt(self, optimizers: Sequence[Optimizer]) -> None:
        """Take the scales the optimizer state says were baked in (a resume without this callback's state)."""
        if not optimizers:
            return
        self.policy.scale = lr_scale_of(optimizers[0])
        groups = eps_groups(optimizers, self.eps_mode)
        if groups:
            self.eps_scale = float(groups[0][2].get(EPS_SCALE_KEY, 1.0))

    def sync(
        self, optimizers: Sequence[Optimizer], schedulers: Sequence[object]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Bring every optimizer and scheduler to the current scales. Returns the eps changes (before, after)."""
        self._schedulers = tuple(id(s) for s in schedulers)
        for opt in optimizers:
            sync_lr_scale(opt, schedulers, self.policy.scale)
        eps_before: dict[str, float] = {}
        eps_after: dict[str, float] = {}
        for i, j, group in eps_groups(optimizers, self.eps_mode):
            moved = sync_eps_scale(group, self.eps_scale, self.max_eps)
            if moved is not None:
                eps_before[f"opt{i}_group{j}"], eps_after[f"opt{i}_group{j}"] = moved
        return eps_before, eps_after

    def eps_applies(self, optimizers: Sequence[Optimizer]) -> bool:
        """Some group eps backoff acts on can still be raised."""
        return any(float(g["eps"]) < self.max_eps for _, _, g in eps_groups(optimizers, self.eps_mode))

    def back_off(
        self,
        optimizers: Sequence[Optimizer],
        schedulers: Sequence[object],
        step: int,
        *,
        lr: bool,
        eps: bool,
        cause: str,
        ran_at: float | None = None,
        restored: RestoredRates | None = None,
    ) -> BackoffResult:
        """Lower the learning rate (one notch, and one more per snapshot the rollback passed over) and/or raise eps,
        now; say what changed."""
        policy = self.policy
        before = policy.scale
        values: dict[str, object] = {}
        lr_text = eps_text = ""
        if lr:
            notches = 1 + self.extra_notches
            policy.back_off(cause, notches, step=step, lr=_lr_of(optimizers), ran_at=ran_at, restored=restored)
            at_floor = policy.scale == before
            values.update(lr_scale_before=before, lr_scale_after=policy.scale)
            lr_text = (
                f"the learning rate is already at its floor min_lr_scale={policy.min_lr_scale:g}"
                if at_floor
                else f"lowered the learning rate to {policy.scale:g}x its schedule (was {before:g}x)"
            )
            if notches > 1 and not at_floor:
                values["lr_notches"] = notches
                lr_text += (
                    f", {notches} notches of lr_factor={policy.lr_factor:g}: the rollback passed over "
                    f"{notches - 1} snapshot(s) taken mid-divergence, each a state that would have diverged again"
                )
        if eps:
            self.eps_scale *= self.eps_factor
        eps_before, eps_after = self.sync(optimizers, schedulers)
        if eps_after:
            values.update(eps_before=eps_before, eps_after=eps_after)
            eps_text = f"raised eps {eps_before} -> {eps_after}"
        elif eps:
            eps_text = f"eps is already at its cap max_eps={self.max_eps:g}"
        return BackoffResult(lr_text, eps_text, values)

    def follow(self, optimizers: Sequence[Optimizer], schedulers: Sequence[object]) -> bool:
        """After the scheduler stepped: the scale follows the schedule (``BackoffPolicy.follow``); True when it moved
        (everything brought to it)."""
        group = optimizers[0].param_groups[0] if optimizers and optimizers[0].param_groups else {}
        if isinstance(group.get("lr"), Tensor) and not group["lr"].is_cpu:
            return False  # a device tensor: reading it every step would be a host read on a healthy step
        lr = _lr_of(optimizers)
        if lr is None or self.policy.follow(lr) is None:
            return False
        self.sync(optimizers, schedulers)
        return True

    def state_dict(self) -> dict[str, object]:
        """The scales and the policy's record, as primitives (``weights_only``-safe)."""
        p = self.policy
        return {
            "version": 1,
            "lr_scale": p.scale,
            "eps_scale": self.eps_scale,
            "backoffs": p.backoffs,
            "last_event_step": p.last_event_step,
            "lr_ceiling": p.ceiling,
            **({"lr_cap": p.cap, "lr_cut": p.cut} if p.cap is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore them; missing keys (older state) read as the defaults."""
        p = self.policy
        p.scale = float(state.get("lr_scale", 1.0))
        self.eps_scale = float(state.get("eps_scale", 1.0))
        p.backoffs = int(state.get("backoffs", 0))
        p.last_event_step = int(state.get("last_event_step", -1))
        p.ceiling = float(state.get("lr_ceiling", 1.0))
        cap = state.get("lr_cap")
        p.cap = None if cap is None else float(cap)
        p.cut = float(state.get("lr_cut", p.scale))


def _lr_of(optimizers: Sequence[Optimizer]) -> float | None:
    """The first param group's learning rate now (a schedule scales every group alike)."""
    if not optimizers or not optimizers[0].param_groups:
        return None
    lr = optimizers[0].param_groups[0].get("lr")
    return float(lr) if isinstance(lr, (int, float, Tensor)) else None
