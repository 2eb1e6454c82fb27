"""What CheckpointGuard's checkpoint IO did with a file, and the sentences that say so.

``CheckpointEvent`` is what ``VerifyingCheckpointIO`` and ``sharded`` report to the callback;
``describe`` and ``incident_values`` turn one into the warning and the incident record; ``load_error`` is the message
of a refused load (the file, the reason, what to try).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_nanguard._files import is_local_path
from lightning_nanguard.checkpointing.verify import last_good_checkpoint

__all__ = ["CheckpointEvent", "EventKind", "describe", "incident_values", "load_error"]

EventKind = Literal["saved", "refused_save", "loaded", "refused_load", "fallback", "unverified", "kept"]


@dataclass(frozen=True)
class CheckpointEvent:
    """What the wrapper did with one file, for the callback to report (``path``: the file Lightning asked for)."""

    kind: EventKind
    path: str
    reason: str = ""
    substitute: str = ""  # for "fallback": the file actually loaded
    tensors: tuple[str, ...] = ()  # for "refused_save": the non-finite tensors
    kept: str = ""  # for "refused_save" / "kept": the newest good checkpoint of that directory, when known
    step: int | None = None  # for "fallback": the global_step of the file loaded instead
    bound: int | None = None  # for "fallback": the requested file's step (no later one is taken), where known


def describe(event: CheckpointEvent, global_step: int | None = None) -> str:
    """The warning for a refused save, a fallback or a refused load (``global_step``: where a refused save was)."""
    if event.kind == "refused_save":
        shown = ", ".join(event.tensors[:3]) + (f" and {len(event.tensors) - 3} more" if len(event.tensors) > 3 else "")
        where = f" at global_step={global_step}" if global_step is not None else ""
        directory = os.path.dirname(os.path.abspath(event.path))
        if event.kept:
            kept = f"the newest good checkpoint stays at {event.kept}"
        else:
            kept = f"no good checkpoint of this run is known in {directory}"
        return (
            f"CheckpointGuard refused to write {event.path}{where}: non-finite values in {shown}. Nothing was "
            f"written; {kept}, and checkpoint retention (ModelCheckpoint's save_top_k) cannot delete files of "
            f"{directory} until a finite checkpoint is written there again. The weights or optimizer state went "
            "non-finite: add GradNormMonitor or AutoRollback to stop such updates, lower the learning rate, or "
            "resume from the last good checkpoint."
        )
    if event.kind == "fallback":
        at = f" of step {event.step}" if event.step is not None else ""
        bound = f"at or before step {event.bound}" if event.bound is not None else "written no later than it"
        return (
            f"CheckpointGuard: {event.path} failed verification ({event.reason}); loaded {event.substitute}{at} "
            f"instead, the verified checkpoint of that directory nearest to it {bound} (with weights_only=True). "
            "trainer.ckpt_path still shows the requested file."
        )
    return f"CheckpointGuard refused to load {event.path}: {event.reason}."


def incident_values(event: CheckpointEvent) -> dict[str, Any]:
    """The incident's ``values`` for ``event``: the file, the reason, and what else the event names."""
    values: dict[str, Any] = {"file": event.path, "reason": event.reason}
    if event.substitute:
        values["loaded"] = event.substitute
    if event.step is not None:
        values["loaded_step"] = event.step
    if event.bound is not None:
        values["requested_step"] = event.bound
    if event.tensors:
        values["nonfinite_tensors"] = ", ".join(event.tensors[:10])
    if event.kept:
        values["kept"] = event.kept
    return values


def load_error(
    path: str,
    reason: str,
    later: Sequence[str] = (),
    *,
    require_sidecar: bool,
    fallback: bool,
    bound: str = "",
    step: int | None = None,
) -> str:
    """The message of a refused load: the file, the reason, and what to try (the verified alternative).

    Args:
        path: the checkpoint that failed verification.
        reason: why.
        later: verified checkpoints of a later step than ``path``'s (or written after it), which a fallback does not
            use.
        require_sidecar: the guard's setting (what counts as verified).
        fallback: the guard's setting (whether it already fell back).
        bound: what a fallback may take (``"at or before step N"``), for the sentence about ``later``.
        step: the requested file's step, where known: the alternative named is of that step or earlier.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tries: list[str] = []
    if later:
        shown = ", ".join(os.path.basename(p) for p in later[:3]) + (" ..." if len(later) > 3 else "")
        tries.append(
            f"no checkpoint of {directory} {bound or 'at or before it'} verifies; the newer verified "
            f"ones ({shown}) were not used, as a fallback never moves past the step you asked for: pass one as "
            "ckpt_path if you mean to resume from it"
        )
    local = is_local_path(path)
    good = last_good_checkpoint(directory, require_sidecar=require_sidecar, at_or_before_step=step) if local else None
    if not later and good is not None and os.path.abspath(good) != os.path.abspath(path):
        auto = "" if fallback else " (or pass CheckpointGuard(fallback=True) to do so automatically)"
        which = f" at or before step {step}" if step is not None else ""
        tries.append(f"resume from the newest verified checkpoint of that directory{which}, {good}{auto}")
    elif fallback and not later:
        tries.append(f"no other checkpoint in {directory} verifies either, so there is nothing to fall back to")
    if "no checksum sidecar" in reason:
        tries.append(
            f"if you trust the file, write its sidecar with `nanguard verify --write-sidecar {path}` "
            "or use CheckpointGuard(require_sidecar=False)"
        )
    hint = "; ".join(tries) if tries else "check the file, or start without ckpt_path"
    return (
        f"nanguard: checkpoint {path} failed verification: {reason}. No weights were loaded from it. "
        f"What to try: {hint}."
    )
