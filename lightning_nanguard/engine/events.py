"""The events of a batch, before the incident path handles them: what was seen, and what is known about it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from lightning_nanguard.contract import Action, Cause, Plan, Signal
from lightning_nanguard.engine.reading import Reading
from lightning_nanguard.policies.loss_scale import CollapseFacts
from lightning_nanguard.policies.remedy import RemedyFacts

__all__ = ["AfterStep", "EventFacts", "PendingEvent"]


@dataclass(frozen=True)
class AfterStep:
    """An event of a step nanguard saw only after someone else applied or dropped its update (DeepSpeed's
    ``engine.step()``): nothing can be undone, replayed or restored. ``facts`` are what the policy decides from
    (``policies.remedy.plan_after_step``); ``narrate`` writes the message given the plan; ``sources`` say who acted,
    by the plan's main action; ``ranks`` is ``()`` where DeepSpeed's own reduction hid them; ``cause`` is one known
    without a diagnosis; ``exited``: the run already ended on its own (reported, nothing decided)."""

    step: int
    ranks: tuple[int, ...]
    facts: RemedyFacts
    narrate: Callable[[Plan], str]
    sources: Mapping[Action, str]
    values: Mapping[str, object] = field(default_factory=dict)
    cause: Cause | None = None
    budget_left: int = -1  # what the budget behind the decision still allows (-1: no budget)
    exited: bool = False


@dataclass(slots=True)
class PendingEvent:
    """One event of the current batch, collected during the step and handled at the batch end."""

    signal: Signal
    readings: list[Reading]
    collapse: CollapseFacts | None = None
    after: AfterStep | None = None


@dataclass
class EventFacts:
    """What the incident path knows about a training-step event before diagnosing it (all rank-consistent)."""

    event: PendingEvent
    step: int
    batch: object
    batch_idx: int
    state_ok: bool
    state_names: tuple[str, ...]
    ranks: tuple[int, ...]
    samples: dict[str, list[int] | None] | None = None  # the batch's samples per loader, where not the quarantine's

    @property
    def signal(self) -> Signal:
        return self.event.signal

    @property
    def readings(self) -> list[Reading]:
        return self.event.readings

    @property
    def scaler_overflow(self) -> bool:
        """A GradScaler overflow of the scaled gradients: loss finite, gradients not, under 16-mixed."""
        return any(r.scale is not None and r.loss_finite and not r.grads_finite for r in self.readings)
