"""The probe's yardstick from the recent past: its own scores at the spikes of the last ``RECENT`` steps.

The newest sound snapshot can be far back: early in a fit it is the untrained model, whose probe loss (4.3 on a small
language model) weights that lost everything they learned since only reach again (4.3 at a divergence at step 39),
never twice. The probe is scored at every spike too, under the weights of that moment; a spike it held (no rise) is
a measured state of the run, a recent one. ``RecentScores`` keeps those scores for ``RECENT`` steps, and the lowest
of them is where the probe was lately (scaled, at a spike, by how much the objective itself moved since the reference
snapshot: its weights' score now over its score then, so that a curriculum stage since moves the yardstick with it).
A restore forgets the scores of the abandoned trajectory. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RECENT", "RecentScores"]

RECENT = 50  # steps a held spike's probe score stays a yardstick (the preset's snapshot cadence)


@dataclass
class RecentScores:
    """The probe's loss at the spikes it held, by step (this trajectory's only)."""

    scores: dict[int, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.scores.clear()

    def add(self, step: int, loss: float) -> None:
        self.scores[step] = loss
        for s in [s for s in self.scores if s < step - RECENT]:
            del self.scores[s]

    def best(self, step: int) -> tuple[int, float] | None:
        """The lowest score of the ``RECENT`` steps before ``step`` and its step (``None``: none)."""
        recent = [(v, s) for s, v in self.scores.items() if step - RECENT <= s < step]
        if not recent:
            return None
        loss, at = min(recent)
        return at, loss

    def restored(self, step: int) -> None:
        """The state of ``step`` was restored: later scores belong to the abandoned trajectory."""
        self.scores = {s: v for s, v in self.scores.items() if s <= step}
