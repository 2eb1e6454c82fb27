"""What the callbacks brought to this fit: each capability registered once, in the callbacks' ``setup``.

A capability that is not registered is never planned (ablation = what is registered); a conflicting duplicate is
refused with ``NanGuardConfigError``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl

from lightning_nanguard.engine.capabilities import Backoff, GuardSettings, MetricSource, Promoter, Restorer, ScaleWatch
from lightning_nanguard.exceptions import NanGuardConfigError
from lightning_nanguard.policies.remedy import Installed
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["Registry"]


class Registry:
    """The capabilities of one fit, and the facts that follow from them."""

    def __init__(self) -> None:
        self.guard: GuardSettings | None = None
        self.quarantine: Quarantine | None = None
        self.restorer: Restorer | None = None
        self.backoff: Backoff | None = None
        self.scale_watch: ScaleWatch | None = None
        self.promoter: Promoter | None = None
        self.metric_sources: list[MetricSource] = []
        # Run first at each batch end, after the optimizer step: DeepSpeed's own step outcome is read there
        # (engine/deepspeed_sensing.py), since its engine steps after the last hook Lightning gives before it.
        self.step_hooks: list[Callable[[pl.Trainer], None]] = []
        self.monitors_steps = False  # some member watches training steps (sensing runs)
        self.spikes: tuple[RunningZScore, RunningZScore] | None = None  # (grad norm, loss)
        self.host_only = False  # a decision needs host values before the update: no device path

    def set_guard(self, settings: GuardSettings, quarantine: Quarantine | None) -> None:
        if self.guard is not None and self.guard != settings:
            raise NanGuardConfigError(
                f"Two GradNormMonitors with different settings are installed ({self.guard} and {settings}): one "
                "guard decides every step. Remove one of them."
            )
        self.guard = settings
        self.quarantine = quarantine
        self.monitors_steps = True
        if settings.spike_zscore is not None:
            self.spikes = (
                RunningZScore(settings.spike_zscore, settings.spike_warmup),
                RunningZScore(settings.spike_zscore, settings.spike_warmup),
            )
        # A spike that must be dropped has to be judged on the host before the update: no device path then.
        self.host_only = (settings.spike_zscore is not None and settings.on_spike != "warn") or (
            settings.on_nonfinite == "warn"
        )

    def set_restorer(self, restorer: Restorer) -> None:
        if self.restorer is not None and self.restorer is not restorer:
            raise _duplicate(restorer)
        self.restorer = restorer
        self.monitors_steps = True

    def set_backoff(self, backoff: Backoff) -> None:
        if self.backoff is not None and self.backoff is not backoff:
            raise _duplicate(backoff)
        self.backoff = backoff

    def set_scale_watch(self, watch: ScaleWatch) -> None:
        if self.scale_watch is not None and self.scale_watch is not watch:
            raise _duplicate(watch)
        self.scale_watch = watch
        self.monitors_steps = True

    def set_promoter(self, promoter: Promoter) -> None:
        if self.promoter is not None and self.promoter is not promoter:
            raise _duplicate(promoter)
        self.promoter = promoter

    def add_metrics(self, source: MetricSource) -> None:
        if source not in self.metric_sources:
            self.metric_sources.append(source)

    # ------------------------------------------------------------------ what follows from them
    def drops_nonfinite(self) -> bool:
        """A non-finite update is dropped (AutoRollback, or GradNormMonitor other than ``on_nonfinite="warn"``)."""
        return self.restorer is not None or (self.guard is not None and self.guard.on_nonfinite != "warn")

    def installed(self, trainer: pl.Trainer) -> Installed:
        """The remedies that exist in this fit, for the policy."""
        backoff = self.backoff
        return Installed(
            drop=self.drops_nonfinite(),
            quarantine=self.quarantine is not None,
            rollback=self.restorer is not None,
            backoff=backoff is not None,
            eps_backoff=backoff is not None and backoff.eps_applies(trainer),
            promote=self.promoter is not None,
        )


def _duplicate(obj: object) -> NanGuardConfigError:
    return NanGuardConfigError(
        f"Two {type(obj).__name__} callbacks are installed on one Trainer: each remedy has one owner. Remove one of "
        "them."
    )
