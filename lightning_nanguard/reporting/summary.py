"""The short summary printed at the end of fit and by ``nanguard report``: true to what was checked."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from lightning_nanguard.reporting.incidents import Incident

__all__ = ["format_summary"]


def format_summary(
    incidents: Sequence[Incident],
    callbacks: Sequence[str],
    path: str | None,
    *,
    monitored: bool = True,
    final_state: str = "",
    notes: Sequence[str] = (),
    limit: int = 8,
    steps: int | None = None,
) -> str:
    """A fixed-width summary: counts by cause and action, the first and last incidents, what was checked.

    Args:
        incidents: the run's incident records, in order.
        callbacks: the nanguard callbacks installed.
        path: where the incident log is, if it was written.
        monitored: whether training steps were checked at all (a callback that watches steps was installed); an
            unchecked run never reads "every step was finite".
        final_state: one phrase on the end-of-fit check of parameters and buffers, ``""`` when not checked.
        notes: extra lines (quarantined data, promoted modules, ...).
        limit: incidents listed; ``0`` lists all of them.
        steps: training steps run in this fit (``None``: not known, as for ``nanguard report``).
    """
    head = f"nanguard summary ({', '.join(callbacks) or 'no callbacks'})"
    lines = [head, "-" * len(head)]
    if not incidents:
        if monitored and steps == 0:
            lines.append("no incidents; no training step ran.")
        elif monitored and steps is not None and steps > 1:
            lines.append(f"no incidents: all {steps} training steps were checked and were finite.")
        elif monitored:
            lines.append("no incidents: every training step was checked and was finite.")
        else:
            lines.append(
                "no incidents recorded, but training steps were not checked: none of the installed callbacks "
                "watches them (GradNormMonitor, AutoRollback and LossScaleWatchdog under 16-mixed do)."
            )
    else:
        by_cause = Counter(i.cause or i.trigger for i in incidents)
        actions = Counter(a for i in incidents for a in (i.actions or [i.action]))
        lines.append(
            f"incidents: {len(incidents)} ("
            + ", ".join(f"{c}={n}" for c, n in sorted(by_cause.items()))
            + ")   actions: "
            + " ".join(f"{a}={n}" for a, n in sorted(actions.items()))
        )
        if limit <= 0 or len(incidents) <= limit:
            shown: list[Incident | None] = list(incidents)
        else:
            shown = [*incidents[: limit // 2], None, *incidents[-(limit - limit // 2) :]]
        for inc in shown:
            if inc is None:
                lines.append(f"  ... {len(incidents) - limit} more ...")
                continue
            what = ", ".join(inc.actions or [inc.action])
            where = f"  {inc.where}" if inc.where else ""
            lines.append(f"  step {inc.step:>7}  {inc.cause or inc.trigger:<24} {what:<28} ranks {inc.ranks}{where}")
    lines.extend(notes)
    if final_state:
        lines.append(f"final parameters and buffers: {final_state}")
    if path:
        lines.append(f"incident log: {path}")
    return "\n".join(lines)
