"""The short summary printed at the end of fit and by ``nanguard report``: true to what was checked."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_nanguard.reporting.incidents import Incident

__all__ = ["FACTS_FILE", "SUMMARY_FILE", "RunFacts", "format_summary"]

# In the run's log directory, written at the end of fit: the summary as printed, and what it says beside the incidents.
SUMMARY_FILE = os.path.join("nanguard", "summary.txt")
FACTS_FILE = os.path.join("nanguard", "summary.json")


@dataclass(frozen=True)
class RunFacts:
    """What the end-of-fit summary says beside the incident records (``format_summary``'s other arguments), saved as
    ``summary.json`` so that ``nanguard report`` prints the same summary from the incident log."""

    callbacks: tuple[str, ...]
    monitored: bool = True
    final_state: str = ""
    notes: tuple[str, ...] = ()
    end_step: int | None = None
    steps: int | None = None
    evaluation: str = ""

    def summary_arguments(self) -> dict[str, Any]:
        """``format_summary``'s keyword arguments these facts fill."""
        return {
            "monitored": self.monitored,
            "final_state": self.final_state,
            "notes": self.notes,
            "end_step": self.end_step,
            "steps": self.steps,
            "evaluation": self.evaluation,
        }

    def to_json(self) -> str:
        return json.dumps({"version": 1, **asdict(self)}, indent=1)

    @classmethod
    def read(cls, path: str) -> tuple[RunFacts | None, str]:
        """The facts in ``path``, or ``None`` and why not (a file that is damaged, or written by another version, is
        a note, never an error: the report then names the callbacks its incidents came from)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            return None, f"{path} is unreadable ({type(err).__name__}); the header names the incidents' callbacks"
        if not isinstance(data, dict) or data.get("version") != 1:
            return None, f"{path} is not a summary this version writes; the header names the incidents' callbacks"
        strings = [data.get("callbacks"), data.get("notes", [])]
        texts = [data.get("final_state", ""), data.get("evaluation", "")]
        counts = [data.get("end_step"), data.get("steps")]
        if (
            not all(isinstance(x, list) and all(isinstance(i, str) for i in x) for x in strings)
            or not all(isinstance(t, str) for t in texts)
            or not all(c is None or (isinstance(c, int) and not isinstance(c, bool)) for c in counts)
            or not isinstance(data.get("monitored", True), bool)
        ):
            return None, f"{path} holds values of the wrong types; the header names the incidents' callbacks"
        return cls(
            callbacks=tuple(data["callbacks"]),
            monitored=data.get("monitored", True),
            final_state=texts[0],
            notes=tuple(data.get("notes", [])),
            end_step=counts[0],
            steps=counts[1],
            evaluation=texts[1],
        ), ""


def format_summary(
    incidents: Sequence[Incident],
    callbacks: Sequence[str],
    path: str | None,
    *,
    monitored: bool = True,
    final_state: str = "",
    notes: Sequence[str] = (),
    limit: int = 8,
    end_step: int | None = None,
    steps: int | None = None,
    evaluation: str = "",
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
        end_step: the step training ended at, where known: a recurring incident whose last repeat is near it is said
            to be still recurring.
        steps: training steps run in this fit (``None``: not known, as for ``nanguard report``).
        evaluation: ``"validate"``, ``"test"`` or ``"predict"`` for a run of that alone (``trainer.test()``): it has
            no training step, so nothing is said of checking them (whichever callbacks watch them).

    A recurring incident (one record with ``repeats``) is listed once, with "N times between steps a and b", and
    whether it stopped recurring: a fault that kept coming back never reads like a recovery.
    """
    head = f"nanguard summary ({', '.join(callbacks) or 'no callbacks'})"
    lines = [head, "-" * len(head)]
    if not incidents:
        if evaluation:
            lines.append(f"no incidents in {evaluation} (no training step runs in it).")
        elif monitored and steps == 0:
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
        by_cause: Counter[object] = Counter()
        actions: Counter[object] = Counter()
        for i in incidents:
            by_cause[i.cause or i.trigger] += i.count
            actions.update(dict.fromkeys(i.actions or [i.action], i.count))
        n = len(incidents)
        records = "" if all(i.repeats == 0 for i in incidents) else f" in {n} record{'' if n == 1 else 's'}"
        lines.append(
            f"incidents: {sum(i.count for i in incidents)}{records} ("
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
            if inc.repeats:
                lines.append(f"{'':15}{_recurrence(inc, end_step)}")
    lines.extend(notes)
    if final_state:
        lines.append(f"final parameters and buffers: {final_state}")
    if path:
        lines.append(f"incident log: {path}")
    return "\n".join(lines)


def _recurrence(inc: Incident, end_step: int | None) -> str:
    """``"132 times between steps 40 and 299, still recurring when training ended"``."""
    text = f"{inc.count} times between steps {inc.step} and {inc.last_step}"
    if end_step is None:
        return text
    gap = (inc.last_step - inc.step) / inc.repeats  # the mean steps between two occurrences
    if end_step - inc.last_step <= max(3 * gap, 1):
        return text + ", still recurring when training ended: not fixed"
    return text + f", none in the last {end_step - inc.last_step} steps"
