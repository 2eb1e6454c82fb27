"""Which verified checkpoint a failed resume falls back to: never one of a later step than the file asked for.

The bound is the requested file's own step, as far as it can be known although the file failed
(``recorded_step``): its sidecar's record, else the ``global_step`` read from it (a file with NaN weights
still loads), else the ``step=N`` of its name. Where none is known (a ``last.ckpt`` that no longer loads and has no
record), the bound is its modification time: no file written after it is taken. Among the files within the bound
the one of the highest step wins (then the newest), and where the requested file's sidecar records its lineage, only
files of that lineage's past count (``checkpointing/lineage.py``): a fallback resumes the trajectory the user chose, never
an abandoned run's file that happens to sit in the same directory.

Resuming from an older file is how a user leaves a trajectory that went bad; its newer files are that trajectory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lightning_nanguard.checkpointing.lineage import Lineage, lineage_of
from lightning_nanguard.checkpointing.manifest import manifest_step, recorded_int, written_ns
from lightning_nanguard.checkpointing.sidecar import meta_of
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME, step_in_name

__all__ = ["FallbackBound", "fallback_bound", "find_fallback", "recorded_step"]


def recorded_step(path: str, read: int | None = None) -> int | None:
    """The ``global_step`` of ``path`` as far as it can be known, even for a file that fails verification: its
    sidecar's record, else ``read`` (the step read from the file, ``VerifyResult.step``), else its name's
    ``step=N``. A distributed checkpoint directory's is its manifest's, or ``None``."""
    if os.path.isdir(path):
        return manifest_step(path)
    step = recorded_int(meta_of(path).get("step"))
    if step is not None:
        return step
    return read if read is not None else step_in_name(path)


@dataclass(frozen=True)
class FallbackBound:
    """What a fallback for one requested file may take: a step at or before ``step`` (or, where it is unknown, a
    file written no later than ``written_ns``), of ``lineage``'s past where it is known."""

    step: int | None
    written_ns: int | None
    lineage: Lineage | None

    def admits(self, candidate: str, step: int) -> bool:
        if self.step is not None and step > self.step:
            return False
        if self.lineage is None:
            return True
        return self.lineage.admits(lineage_of(meta_of(candidate)), step, self.step if self.step is not None else step)

    def describe(self) -> str:
        """``at or before step N`` / ``written no later than it``, for the messages."""
        return f"at or before step {self.step}" if self.step is not None else "written no later than it"


def fallback_bound(requested: str, read_step: int | None = None) -> FallbackBound:
    """The bound of a fallback for ``requested`` (``read_step``: the step read from it, when it loaded)."""
    step = recorded_step(requested, read_step)
    written = None
    if step is None and os.path.lexists(requested):
        try:
            written = written_ns(requested)
        except OSError:  # a dangling symlink: the time of the link itself
            written = os.lstat(requested).st_mtime_ns
    return FallbackBound(step, written, lineage_of(meta_of(requested)) if os.path.exists(requested) else None)


def _order(candidates: Iterable[str]) -> list[str]:
    """Highest recorded step first (a sidecar's record or the name's ``step=N``), then the newest; files whose step
    is not known without loading them come after, newest first; at a tie the original before the tag."""
    keyed = []
    for path in candidates:
        try:
            mtime = written_ns(path)
        except OSError:
            continue
        step = recorded_step(path)
        keyed.append((step is not None, step or 0, mtime, os.path.basename(path) != LAST_GOOD_NAME, path))
    return [k[-1] for k in sorted(keyed, reverse=True)]


def find_fallback(
    requested: str,
    candidates: Iterable[str],
    verify: Callable[[str], tuple[bool, int | None, Any]],
    bound: FallbackBound,
) -> tuple[str | None, Any, list[str]]:
    """The first of ``candidates`` (in ``_order``) that ``verify`` passes as a Lightning checkpoint (``(ok, its
    global_step, what it loaded)``) within ``bound``: ``(path, what it loaded, the verified ones passed over for a
    later step)``, or ``(None, None, those passed over)``.

    Only ``requested`` itself is skipped: a hard link to the same content (the tag) has its own sidecar, and
    re-verifying it is what lets a file that merely lost its sidecar fall back to its tag.
    """
    later: list[str] = []
    for candidate in _order(candidates):
        if os.path.abspath(candidate) == os.path.abspath(requested):
            continue
        ok, step, loaded = verify(candidate)
        if not ok or step is None:  # failed, or not a Lightning checkpoint: nothing to resume from
            continue
        if (bound.step is not None and step > bound.step) or (
            bound.written_ns is not None and written_ns(candidate) > bound.written_ns
        ):
            later.append(candidate)
            continue
        if not bound.admits(candidate, step):
            continue  # another run's past: not the trajectory the requested file belongs to
        return candidate, loaded, later
    return None, None, later
