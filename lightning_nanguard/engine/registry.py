"""What the callbacks brought to this fit: each capability registered once, in the callbacks' ``setup``.

A capability that is not registered is never planned (ablation = what is registered). One callback of each kind:
a second one (other settings or the same) is refused with ``NanGuardConfigError`` when it joins, in its ``setup``,
before any step (``admit``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_nanguard.config import GradNormMonitorConfig
from lightning_nanguard.engine.capabilities import Backoff, MetricSource, Promoter, Restorer, ScaleWatch
from lightning_nanguard.exceptions import NanGuardConfigError
from lightning_nanguard.policies.remedy import Installed
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.signals.loss_climb import ClimbingLoss
from lightning_nanguard.signals.spike import RunningZScore

__all__ = ["Registry", "settings_text"]


class Registry:
    """The capabilities of one fit, and the facts that follow from them."""

    def __init__(self) -> None:
        self.guard: GradNormMonitorConfig | None = None
        self.quarantine: Quarantine | None = None
        self.restorer: Restorer | None = None
        self.backoff: Backoff | None = None
        self.scale_watch: ScaleWatch | None = None
        self.promoter: Promoter | None = None
        self.metric_sources: list[MetricSource] = []
        self.summary_notes: list[Callable[[], list[str]]] = []  # lines a member adds to the end-of-fit summary
        # Run first at each batch end, after the optimizer step: DeepSpeed's own step outcome is read there
        # (parts/deepspeed_sensing.py), since its engine steps after the last hook Lightning gives before it.
        self.step_hooks: list[Callable[[pl.Trainer], None]] = []
        self.monitors_steps = False  # some member watches training steps (sensing runs)
        self.spikes: tuple[RunningZScore, RunningZScore] | None = None  # (grad norm, loss)
        self.host_only = False  # a decision needs host values before the update: no device path
        self.kinds: dict[str, Callback] = {}  # one member per kind (its nanguard class's name)

    def admit(self, member: Callback) -> None:
        """Let ``member`` join this fit, unless a callback of its kind already has.

        Raises:
            NanGuardConfigError: a second callback of one kind, naming both and what to do.
        """
        kind = _kind(member)
        first = self.kinds.setdefault(kind.__name__, member)
        if first is not member:
            raise _second_of_a_kind(kind, first, member)

    def set_guard(self, settings: GradNormMonitorConfig, quarantine: Quarantine | None) -> None:
        if self.guard is not None and self.guard != settings:
            raise NanGuardConfigError(
                f"Two GradNormMonitors with different settings are installed ({self.guard} and {settings}): one "
                "guard decides every step. Remove one of them."
            )
        self.guard = settings
        self.quarantine = quarantine
        self.monitors_steps = True
        if settings.spike_zscore is not None:
            # Probed, a loss that climbs and stays up is probed too (``signals.loss_climb``): the probe decides.
            loss = ClimbingLoss if settings.on_spike == "probe" else RunningZScore
            self.spikes = (
                RunningZScore(settings.spike_zscore, settings.spike_warmup),
                loss(settings.spike_zscore, settings.spike_warmup),
            )
        # A spike that must be dropped has to be judged on the host before the update: no device path then (a probed
        # spike is judged after it, when its verdict reaches the host).
        self.host_only = (settings.spike_zscore is not None and settings.on_spike in ("skip", "rollback")) or (
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

    def add_summary_notes(self, source: Callable[[], list[str]]) -> None:
        if source not in self.summary_notes:
            self.summary_notes.append(source)

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


def _kind(member: Callback) -> type:
    """The nanguard class ``member`` is (a user's subclass of GradNormMonitor is a GradNormMonitor)."""
    for cls in type(member).__mro__:
        if cls.__module__.startswith("lightning_nanguard.callbacks."):
            return cls
    return type(member)


def _settings(kind: type, member: Callback) -> dict[str, object]:
    """``member``'s constructor arguments that differ from ``kind``'s defaults (read back from its attributes)."""
    out: dict[str, object] = {}
    for name, param in inspect.signature(kind).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or not hasattr(member, name):
            continue
        value, default = getattr(member, name), param.default
        if isinstance(value, (set, frozenset)):  # kept parsed (OptimizerBackoff's triggers="a,b")
            same = isinstance(default, str) and set(default.split(",")) == set(value)
            value = ",".join(sorted(value))
        else:
            same = value == default
        if not same:
            out[name] = value
    return out


def settings_text(member: Callback) -> str:
    """``member`` as the call that builds it: ``"GradNormMonitor(layer_depth=2)"``."""
    kind = _kind(member)
    args = ", ".join(f"{k}={v!r}" for k, v in _settings(kind, member).items())
    return f"{kind.__name__}({args})"


def _second_of_a_kind(kind: type, first: Callback, second: Callback) -> NanGuardConfigError:
    name, a, b = kind.__name__, settings_text(first), settings_text(second)
    same = " (the same settings)" if a == b else ""
    override = _settings(kind, second)
    how = (
        f"to change the one default_callbacks() builds, pass the settings there: default_callbacks({name}="
        f"{override!r}), instead of adding a second {name}"
        if override
        else "remove one of them"
    )
    return NanGuardConfigError(
        f"Two {name} callbacks are installed on one Trainer: {a} and {b}{same}. nanguard runs one callback of each "
        f"kind per Trainer (the second would be ignored or would conflict with the first). Keep one: {how}."
    )


def _duplicate(obj: object) -> NanGuardConfigError:
    return NanGuardConfigError(
        f"Two {type(obj).__name__} callbacks are installed on one Trainer: each remedy has one owner. Remove one of "
        "them."
    )
