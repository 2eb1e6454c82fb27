"""The events of a batch, before the incident path handles them: what was seen, and what is known about it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.contract import Action, Cause, Plan, Signal
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.policies.loss_scale import CollapseFacts
from lightning_nanguard.policies.remedy import RemedyFacts

__all__ = ["AfterStep", "EventFacts", "PendingEvent"]


@dataclass(frozen=True)
class AfterStep:
    """An event of a step nanguard saw only after someone else applied or dropped its update (DeepSpeed's
    ``engine.step()``): nothing can be undone, diagnosed by a replay or restored; the policy decides whether it is
    counted, warned about or ends training (``policies.remedy.plan_after_step``).

    Attributes:
        step: the step the event belongs to.
        ranks: the ranks it started on (``[]``: not known, e.g. after DeepSpeed's own reduction).
        facts: what the policy decides from.
        narrate: the incident's message, given the plan.
        sources: who acted, by the plan's main action (``"DeepSpeed"``, ``"LossScaleWatchdog"``).
        values: the readings behind it, for the record.
        cause: the cause, where one is known without a diagnosis (non-finite weights after a collapse).
        budget_left: what the budget behind the decision still allows (``-1``: no budget).
        exited: the run already ended on its own (DeepSpeed's exit): reported, nothing is decided.
    """

    step: int
    ranks: tuple[int, ...]
    facts: RemedyFacts
    narrate: Callable[[Plan], str]
    sources: Mapping[Action, str]
    values: Mapping[str, Any] = field(default_factory=dict)
    cause: Cause | None = None
    budget_left: int = -1
    exited: bool = False


class PendingEvent:
    """One event of the current batch, collected during the step and handled at the batch end."""

    __slots__ = ("after", "collapse", "readings", "signal")

    def __init__(
        self,
        signal: Signal,
        readings: list[Reading],
        collapse: CollapseFacts | None = None,
        after: AfterStep | None = None,
    ) -> None:
        self.signal = signal
        self.readings = readings
        self.collapse = collapse
        self.after = after


class EventFacts:
    """What the incident path knows about a training-step event before diagnosing it (all rank-consistent)."""

    def __init__(
        self,
        event: PendingEvent,
        *,
        step: int,
        batch: Any,
        batch_idx: int,
        state_ok: bool,
        state_names: Sequence[str],
        ranks: Sequence[int],
    ) -> None:
        self.event = event
        self.signal = event.signal
        self.readings: list[Reading] = event.readings
        self.step = step
        self.batch = batch
        self.batch_idx = batch_idx
        self.state_ok = state_ok
        self.state_names = tuple(state_names)
        self.ranks = tuple(ranks)

    @property
    def scaler_overflow(self) -> bool:
        """A GradScaler overflow of the scaled gradients: loss finite, gradients not, under 16-mixed."""
        return any(r.scale is not None and r.loss_finite and not r.grads_finite for r in self.readings)
