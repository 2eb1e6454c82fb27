"""How many snapshot slots a host-memory budget holds: all of them, fewer (with a warning), or none (refused).

Fewer slots rather than a refusal when at least one fits: the budget is the user's ceiling on host memory, and one
verified snapshot still rolls a damaged state back (a recurrence then falls back to the newest verified checkpoint on
disk). A refusal when not even one fits, because a ring that can hold nothing would silently turn every rollback
into a disk restore or a stop; the message says what one snapshot needs and the ways out.
"""

from __future__ import annotations

from lightning_nanguard import _notices
from lightning_nanguard.exceptions import NanGuardConfigError

__all__ = ["slots_that_fit"]


def slots_that_fit(max_bytes: int | None, need: int, slots: int, *, world: int, sharded: bool) -> int:
    """The number of slots of ``need`` bytes each (per rank) that ``max_bytes`` holds, at most ``slots``.

    Raises:
        NanGuardConfigError: not even one fits.
    """
    if max_bytes is None or need == 0:
        return slots
    fits = max_bytes // need
    if fits < 1:
        what = (
            f"its share of the parameters and optimizer state over {world} DDP ranks, and its buffers"
            if sharded
            else "a full copy of this rank's parameters, buffers and optimizer state"
        )
        raise NanGuardConfigError(
            f"AutoRollback(max_snapshot_bytes={max_bytes}): one snapshot of this training state needs {need} bytes "
            f"on each rank ({what}); must be >= {need}, or None for no limit. Or keep the snapshots on disk "
            "(source='disk'), or train on more DDP ranks (each keeps 1/world of a snapshot)."
        )
    if fits < slots:
        _notices.warn(
            f"nanguard: AutoRollback(max_snapshot_bytes={max_bytes}) holds {fits} of the {slots} snapshots of {need} "
            f"bytes each (per rank): keeping {fits}. Set max_snapshot_bytes >= {need * slots} to keep them all, or "
            "lower num_snapshots."
        )
        return fits
    return slots
