"""How far to back off the learning rate and when to recover it: the arithmetic behind OptimizerBackoff.

Pure: step numbers in, scale changes out. *When* to back off is the remedy policy's decision (``policies.remedy``);
the callback applies the scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_nanguard.exceptions import NanGuardConfigError, brief
from lightning_nanguard.policies.snapshot_rates import RestoredRates

__all__ = ["TRIGGERS", "BackoffPolicy", "ScaleChange", "check_triggers", "parse_triggers"]

# The event kinds that may lower the learning rate, by name in ``OptimizerBackoff(triggers=...)``.
TRIGGERS = ("rollback", "skip", "loss_scale_collapse")


def parse_triggers(on: str) -> frozenset[str]:
    """``"rollback, skip"`` -> ``{"rollback", "skip"}``. Raises ValueError naming the unknown ones, or when empty."""
    names = frozenset(part.strip() for part in on.split(",") if part.strip())
    if not names:
        raise ValueError(f"names no trigger, so the learning rate would never back off; choose from {list(TRIGGERS)}")
    unknown = sorted(names.difference(TRIGGERS))
    if unknown:
        raise ValueError(f"unknown trigger(s) {unknown}; choose from {list(TRIGGERS)}")
    return names


def check_triggers(owner: str, triggers: object) -> frozenset[str]:
    """``parse_triggers`` for a constructor argument: ``NanGuardConfigError`` naming the argument and the rule."""
    if not isinstance(triggers, str):
        raise NanGuardConfigError(
            f"{owner}(triggers={brief(triggers)}): must be a comma-separated string of trigger names."
        )
    try:
        return parse_triggers(triggers)
    except ValueError as err:
        raise NanGuardConfigError(f"{owner}(triggers={brief(triggers)}): {err}.") from None


@dataclass(frozen=True)
class ScaleChange:
    """One decided change of the learning-rate scale (and whether eps should back off with it)."""

    before: float
    after: float
    cause: str
    eps: bool = False


@dataclass
class BackoffPolicy:
    """Decide backoffs and recoveries of a multiplicative learning-rate scale (1.0 = the schedule as configured).

    Args:
        lr_factor: multiply the scale by this on each backoff, in (0, 1).
        min_lr_scale: the floor of the scale; a backoff at the floor changes nothing.
        on: the event kinds that may cause a backoff (see ``TRIGGERS``).
        skips_before_backoff: dropped updates needed within ``skip_window`` steps for one backoff.
        skip_window: the window, in optimizer steps, those skips are counted over.
        recover_after: healthy optimizer steps (no incident at all) before the scale is raised one notch;
            ``None``: never recover.
        recover_steps: notches to climb from one backoff back to the previous level: each notch multiplies the
            scale by ``(1 / lr_factor) ** (1 / recover_steps)``, capped at 1.0.
        follow_schedule: a backoff sets a ``cap`` on the rate, held through the schedule: one ``lr_factor`` notch
            (per notch of the backoff) below the rate the step that diverged ran with, and not above the rate the
            restored state had trained soundly at (``RestoredRates.trained``); where that is not known, not above the lowest
            rate the snapshots kept up to the restored one were taken at unless that is more than one further notch
            below. Where the schedule rises past the cap (the rest of a warmup, the next restart),
            the scale comes down so the rate stays at the cap: a multiplier on a rising schedule would take it past
            the stability edge again. As the schedule itself falls below the cap (a decay, the end of a warm
            restart), the scale climbs back (``follow``), up to ``ceiling``, exactly as far as keeps the rate at the
            cap: the cause a backoff answered (a rate too high) is gone before the scale climbs.

    A level that recovery climbed to and that did not last (a backoff within ``recover_after`` steps of the notch
    that reached it) was too high: recovery stops below it from then on (``ceiling``), instead of climbing back into
    the same trouble every ``recover_after`` steps.
    """

    lr_factor: float = 0.5
    min_lr_scale: float = 0.01
    on: frozenset[str] = frozenset({"rollback", "skip", "loss_scale_collapse"})
    skips_before_backoff: int = 3
    skip_window: int = 100
    recover_after: int | None = None
    recover_steps: int = 1
    scale: float = 1.0
    backoffs: int = 0
    last_event_step: int = -1
    ceiling: float = 1.0  # recovery never climbs above this (a level it reached before did not last)
    last_recovery: tuple[int, float] | None = None  # (step, scale before) of the last recovery notch
    follow_schedule: bool = False
    cap: float | None = None  # the learning rate the last backoff left (``follow_schedule``)
    cut: float = 1.0  # the scale the last backoff left (before holding the rate at the cap)

    def back_off(
        self,
        cause: str,
        notches: int = 1,
        step: int | None = None,
        lr: float | None = None,
        ran_at: float | None = None,
        restored: RestoredRates | None = None,
    ) -> ScaleChange:
        """Lower the scale ``notches`` steps of ``lr_factor`` (not below the floor). ``before == after`` at the floor.

        More than one notch answers more than one divergence at once: a rollback that passed over snapshots taken
        mid-divergence (each would have led back into it, and been met with a backoff of its own). ``step``: the
        post-step ``global_step`` now, to tell whether the level a recovery notch reached did not last. ``lr``: the
        learning rate now, before this backoff (the schedule times the old scale). ``follow_schedule`` only:
        ``ran_at``, the rate the step that diverged ran with (``lr`` where not known); ``restored``, the rates the
        kept snapshots up to the one a rollback just restored were taken and trained at (``None``: no rollback).
        """
        before = self.scale
        if step is not None and self.last_recovery is not None and self.recover_after is not None:
            notch_step, below = self.last_recovery
            if step - notch_step <= self.recover_after:
                self.ceiling = min(self.ceiling, below)
        self.last_recovery = None
        self.scale = max(before * self.lr_factor ** max(1, notches), self.min_lr_scale)
        if self.scale < before:
            self.backoffs += 1
        if self.follow_schedule and lr is not None and before > 0 and math.isfinite(lr) and lr > 0:
            diverged_at = ran_at if ran_at is not None and _rate(ran_at) else lr
            cap = diverged_at * self.scale / before
            trained, taken = (restored.trained, restored.taken) if restored is not None else (None, None)
            if trained is not None and _rate(trained) and trained < diverged_at:
                # The restored state trained soundly at this rate: back to it, not above it. (A state that trained at
                # the very rate that diverged proves nothing: it was taken as the climb began.)
                cap = min(cap, trained)
            elif taken is not None and _rate(taken):
                # No rate it trained at is known (a snapshot from the start of the fit): not above the rate it was
                # taken at, nor more than one notch below ``cap``.
                cap = min(cap, max(taken, cap * self.lr_factor))
            self.cap, self.cut = cap, self.scale
            # The schedule rose since the step that diverged (a warmup): the rate is held at the cap from now on.
            self.scale = max(self.min_lr_scale, min(self.scale, self.cap / (lr / before)))
        return ScaleChange(before=before, after=self.scale, cause=cause, eps=True)

    def follow(self, lr: float) -> ScaleChange | None:
        """``follow_schedule``: ``lr`` is the learning rate now (the schedule times ``scale``), after the scheduler
        stepped. The scale that keeps the rate at the cap, within ``[min_lr_scale, ceiling]``; the change, or
        ``None``."""
        if not self.follow_schedule or self.cap is None or not lr > 0:
            return None
        wanted = max(self.min_lr_scale, min(self.ceiling, self.cap / (lr / self.scale)))
        if math.isclose(wanted, self.scale, rel_tol=1e-9):
            return None
        before, self.scale = self.scale, wanted
        return ScaleChange(before=before, after=self.scale, cause="schedule")

    def tick(self, step: int) -> ScaleChange | None:
        """A step ended at ``step`` (after its scheduler step). Returns a recovery notch when one is due."""
        if self.recover_after is None or self.scale >= self.ceiling or math.isclose(self.scale, self.ceiling):
            return None
        if self.last_event_step < 0:
            self.last_event_step = step
        # ``step`` is the post-step ``global_step``; an incident was stamped with the pre-step one.
        if step - self.last_event_step <= self.recover_after:
            return None
        before = self.scale
        notch = (1.0 / self.lr_factor) ** (1.0 / self.recover_steps)
        after = before * notch
        # Land exactly on the ceiling (1.0, or a level that did not last) despite float error in the root.
        top = self.ceiling
        self.scale = top if after >= top or math.isclose(after, top, rel_tol=1e-9) else after
        self.last_event_step = step - 1
        self.last_recovery = (step, before)
        self.cut = max(self.cut, self.scale)
        if self.cap is not None and before > 0:  # ``follow`` keeps what this notch recovered: the cap climbs with it
            self.cap *= self.scale / before
        return ScaleChange(before=before, after=self.scale, cause="recovery")


def _rate(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0
