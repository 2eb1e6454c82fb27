"""Which checkpoint files belong to the run's own past: the runs a fit descends from, and where it left each.

Every fit under CheckpointGuard gets a run id. Its *lineage* is the list of ``(run id, the global_step it started
at)`` from the oldest known run to itself: a fresh fit is ``[(me, 0)]``; a fit resumed from a file extends that
file's lineage with ``(me, the file's global_step)``. Each file's sidecar records the lineage of the run that wrote
it (``checkpointing/sidecar.py``), so a file's writer is its lineage's last run.

A file is the run's own past (``Lineage.admits``) when its step is at or before the current step and

* its writer is in the lineage, and the file is of a step at or before the one where the lineage left that run
  (the next run's start; the current step for the run itself): a later file of an ancestor is the future of an
  abandoned trajectory (a resume from step 32 abandons the step-48 file the first run wrote);
* or nothing says otherwise: the file has no record, or its writer is not in the lineage, and it is of a step at or
  before the oldest known run's start, when that run was itself resumed from a file without a record (whose past is
  unknown). A fresh fit's lineage starts at step 0, so then no such file is its past.

A disk rollback and a resume fallback take only files the lineage admits. Nothing here reads a file or calls a
collective: rank 0 decides, and broadcasts what it chose.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Lineage", "lineage_of"]


@dataclass(frozen=True)
class Lineage:
    """``runs``: ``(run id, the global_step it started at)``, oldest first; the last is the run itself."""

    runs: tuple[tuple[str, int], ...]

    @classmethod
    def fresh(cls) -> Lineage:
        """A fit that starts from step 0 (a resume replaces it with ``resumed_from``)."""
        return cls(((uuid.uuid4().hex[:12], 0),))

    @property
    def run(self) -> str:
        return self.runs[-1][0]

    def resumed_from(self, parent: Lineage | None, step: int) -> Lineage:
        """This run, resumed from a file of ``parent``'s lineage (``None``: a file without a record) at ``step``."""
        known = parent.runs if parent is not None else ()
        return Lineage((*known, (self.run, int(step))))

    def to_meta(self) -> list[list[Any]]:
        """As recorded in a sidecar or manifest (JSON)."""
        return [[run, start] for run, start in self.runs]

    def admits(self, writer_lineage: Lineage | None, step: int, now: int) -> bool:
        """Is a file of ``step``, written by the last run of ``writer_lineage`` (``None``: no record), this run's
        past, at the current step ``now``? (See the module.)"""
        if step > now:
            return False
        ids = [run for run, _ in self.runs]
        writer = writer_lineage.run if writer_lineage is not None else None
        if writer is not None and writer in ids:
            i = ids.index(writer)
            end = self.runs[i + 1][1] if i + 1 < len(self.runs) else now
            return step <= end
        root_start = self.runs[0][1]
        return root_start > 0 and step <= root_start


def lineage_of(meta: dict[str, Any] | None) -> Lineage | None:
    """The lineage a sidecar or manifest records (``meta["lineage"]``), or ``None`` when it records none (or a
    malformed one)."""
    raw = (meta or {}).get("lineage")
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        return None
    runs: list[tuple[str, int]] = []
    for entry in raw:
        if (
            not isinstance(entry, Sequence)
            or isinstance(entry, str)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], int)
            or isinstance(entry[1], bool)
        ):
            return None
        runs.append((entry[0], entry[1]))
    return Lineage(tuple(runs))
