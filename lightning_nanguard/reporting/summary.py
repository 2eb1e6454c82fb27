"""The one-screen summary printed at the end of fit."""

from __future__ import annotations

from collections import Counter

from lightning_nanguard.reporting.incidents import Incident

__all__ = ["format_summary"]


def format_summary(incidents: list[Incident], callbacks: list[str], path: str | None, limit: int = 8) -> str:
    """A short, fixed-width summary: counts per action and trigger, the first and last incidents, where the log is."""
    head = f"nanguard summary ({', '.join(callbacks) or 'no callbacks'})"
    lines = [head, "-" * len(head)]
    if not incidents:
        lines.append("no incidents: every step was finite.")
    else:
        by_action = Counter(i.action for i in incidents)
        by_trigger = Counter(i.trigger for i in incidents)
        lines.append(f"incidents: {len(incidents)}  " + "  ".join(f"{a}={n}" for a, n in sorted(by_action.items())))
        lines.append("triggers:  " + "  ".join(f"{t}={n}" for t, n in sorted(by_trigger.items())))
        shown = incidents if len(incidents) <= limit else [*incidents[: limit // 2], *incidents[-limit // 2 :]]
        for i, inc in enumerate(shown):
            if len(incidents) > limit and i == limit // 2:
                lines.append(f"  ... {len(incidents) - limit} more ...")
            lines.append(
                f"  step {inc.step:>7}  {inc.action:<11} {inc.trigger:<26} by {inc.source:<18} ranks {inc.ranks}"
            )
    if path:
        lines.append(f"incident log: {path}")
    return "\n".join(lines)
