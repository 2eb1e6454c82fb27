"""Checkpoint integrity: sha256 sidecars, verification, and the newest verified checkpoint in a directory.

A checkpoint ``X.ckpt`` is *verified* when its sidecar ``X.ckpt.checksum`` (``checkpointing/sidecar.py``; an older
``X.ckpt.sha256`` is read too) exists and matches the file's sha256, the file loads with
``torch.load(weights_only=True)``, and every floating-point (and complex) tensor of its weights is finite:
``state_dict`` and ``optimizer_states`` of a Lightning checkpoint, every tensor of any other layout (a plain
``torch.save(model.state_dict())``, ``{"model": ...}``, a list). The sidecar is in ``sha256sum`` format, so
``sha256sum -c X.ckpt.checksum`` works too. Where a file has no sidecar (``require_sidecar=False``), the CRC-32 that
torch's zip format stores for every member is checked instead, so a flipped bit in a tensor's bytes is still caught.

Intended infinities (a buffer that holds a mask of -inf by design) are checked for NaN only; which ones are
intended is decided in ``checkpointing/infinities.py`` (the sidecar's record, or the live module's own buffers).

A distributed checkpoint (a directory written by ``ModelParallelStrategy(save_distributed_checkpoint=True)`` under
CheckpointGuard) is verified by its ``nanguard-manifest.json`` instead: every file's size and sha256, no unlisted
shard, and the finiteness recorded at save time (``checkpointing/manifest.py``).

No Trainer needed: these functions are usable from any script (``nanguard verify``, a resume by hand).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_nanguard._files import hash_file
from lightning_nanguard._lightning_compat import foreach_norms
from lightning_nanguard.checkpointing.infinities import intended_infinities_of
from lightning_nanguard.checkpointing.manifest import (
    is_distributed_checkpoint,
    manifest_step,
    verify_directory,
    written_ns,
)
from lightning_nanguard.checkpointing.sidecar import (
    SIDECAR_SUFFIX,
    check_zip_crc,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from lightning_nanguard.signals.stored import stored_values

__all__ = [
    "LAST_GOOD_NAME",
    "SIDECAR_SUFFIX",
    "VerifyResult",
    "check_sidecar",
    "check_zip_crc",
    "checkpoint_candidates",
    "checkpoint_files",
    "checkpoint_step",
    "last_good_checkpoint",
    "nonfinite_tensors",
    "step_in_name",
    "verified_step",
    "verify_and_load",
    "verify_checkpoint",
    "write_sidecar",
]

# The hard link CheckpointGuard keeps to the newest verified checkpoint of a directory (with its own sidecar).
# Not ``last*.ckpt``: ModelCheckpoint's ``ckpt_path="last"`` lookup matches ``^last`` and must not pick it up.
LAST_GOOD_NAME = "nanguard-last-good.ckpt"


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of ``verify_checkpoint``: ``ok`` and, when not ok, one sentence saying why; ``note``: what a
    passing file holds that is worth saying (infinities taken as intended without a record)."""

    path: str
    ok: bool
    reason: str = ""
    note: str = ""
    step: int | None = None  # its global_step, where it could be read


def nonfinite_tensors(checkpoint: object, intended: Collection[str] = ()) -> list[str]:
    """Names of the non-finite floating-point or complex tensors of a checkpoint's weights and optimizer states.

    A Lightning checkpoint (a dict with a ``"state_dict"``) is checked in ``state_dict`` and ``optimizer_states``
    only: callback states legitimately hold infinities (EarlyStopping's initial ``best_score``). Any other layout (a
    plain state dict, ``{"model": ...}``, a bare tensor, a list) is checked everywhere, so nothing is blessed just
    because it is not laid out the way Lightning writes.

    One fused 2-norm pass per (device, dtype) group (float32 accumulation) and one host read. A 2-norm propagates
    NaN/inf, so a tensor with a finite norm is finite; a non-finite norm can also be an overflow of large, finite
    values (Adam's second moments), so those few tensors are confirmed one by one. Complex tensors are checked
    through their real view (a complex NaN is a NaN in its real or imaginary part).

    Args:
        checkpoint: what ``torch.load`` returned (or what is about to be saved).
        intended: ``state_dict`` keys (a plain state dict's keys) whose infinities are intended: checked for NaN only.
    """
    names: list[str] = []
    tensors: list[Tensor] = []
    keys: list[str | None] = []  # the state-dict key of each tensor, where it has one

    def walk(prefix: str, obj: object, key: str | None) -> None:
        if isinstance(obj, Tensor):
            t = stored_values(obj)  # a sparse tensor's stored values, a complex tensor's real view
            if t is not None and t.numel() and t.is_floating_point():
                names.append(prefix or "tensor")
                tensors.append(t.detach())
                keys.append(key)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v, str(k) if key == "" else None)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}[{i}]", v, None)

    if isinstance(checkpoint, dict) and "state_dict" in checkpoint:
        walk("state_dict", checkpoint.get("state_dict", {}), "")
        walk("optimizer_states", checkpoint.get("optimizer_states", []), None)
    else:
        walk("", checkpoint, "")
    if not tensors:
        return []
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(i)
    order: list[int] = []
    flags: list[Tensor] = []
    for positions in groups.values():
        # float32 accumulation; float64 tensors (no downcast) keep their own dtype
        norms = torch.stack(foreach_norms([tensors[i] for i in positions], dtypes=(torch.float32,)))
        flags.append((~torch.isfinite(norms)).cpu())
        order.extend(positions)
    suspect = torch.cat(flags)
    if not bool(suspect.any()):  # the one host read on the healthy path
        return []
    suspects = sorted(order[i] for i in torch.nonzero(suspect).reshape(-1).tolist())
    allowed = set(intended)
    bad: list[str] = []
    for j in suspects:
        t = tensors[j]
        if keys[j] in allowed:
            if bool(torch.isnan(t).any()):
                bad.append(names[j])
        elif not bool(torch.isfinite(t).all()):
            bad.append(names[j])
    return bad


def check_sidecar(path: str, *, require_sidecar: bool = True) -> str | None:
    """Why ``path`` fails its existence and checksum check, or ``None`` when it passes.

    A symlink without a sidecar of its own (ModelCheckpoint's ``save_last="link"``) is checked against its target's.
    A stale sidecar (the file was written again after it: ``checkpointing/sidecar.py``) is no evidence either way: the file
    is checked as one without a sidecar (its zip CRC-32s), whatever ``require_sidecar`` says, and ``verify_and_load``
    says so in its note. Not the ``nanguard-last-good.ckpt`` tag: nanguard writes it and its sidecar together, so a
    tag that no longer matches was changed behind its back (its source rewritten in place) and fails.
    """
    return _check_sidecar(path, require_sidecar=require_sidecar)[0]


def _check_sidecar(path: str, *, require_sidecar: bool) -> tuple[str | None, str]:
    """``check_sidecar``'s verdict and a note (a stale sidecar that was passed over)."""
    if not os.path.isfile(path):
        if os.path.islink(path):
            reason = f"it is a symlink to {os.readlink(path)}, which does not exist (that save was refused or removed)"
            return reason, ""
        if os.path.isdir(path):
            reason = (
                "it is a directory, not a checkpoint file: a distributed checkpoint is verified by "
                "verify_checkpoint (its manifest), not loaded as one file"
            )
            return reason, ""
        return "file does not exist", ""
    sidecar = read_sidecar(path)
    if sidecar is None:
        if require_sidecar:
            reason = (
                f"no checksum sidecar {os.path.basename(sidecar_path(path))} (the file was not written by "
                "CheckpointGuard, or the save was interrupted before the sidecar was written)"
            )
            return reason, ""
        return check_zip_crc(path), ""  # no sha256 to compare with: the CRC-32s torch's zip format stores
    if not sidecar.digest:
        return f"checksum sidecar {os.path.basename(sidecar.path)} is empty or unreadable (it holds no sha256)", ""
    name = os.path.basename(sidecar.path)
    if sidecar.stale and os.path.basename(path) != LAST_GOOD_NAME:
        note = (
            f"its sidecar {name} is stale (the file was written again after it, by a save without CheckpointGuard), "
            "so the file was verified on its own: zip CRC-32s, a weights-only load, finiteness"
        )
        return None, note  # its zip CRC-32s passed (``Sidecar.stale``); the load and finiteness follow
    if sidecar.stale or hash_file(path)[1] != sidecar.digest:
        return f"sha256 does not match {name} (the file is corrupt, truncated or was modified)", ""
    return None, ""


def verify_and_load(
    path: str,
    *,
    require_sidecar: bool = True,
    load: Callable[[str], Any] | None = None,
    module: nn.Module | None = None,
) -> tuple[VerifyResult, Any]:
    """Verify ``path`` and return its loaded contents too, so that a caller that wants them reads the file once.

    Args:
        path: the checkpoint file.
        require_sidecar: fail a file that has no sidecar (otherwise only the contents are checked).
        load: how to read the file; default ``torch.load(path, map_location="cpu", weights_only=True)``.
        module: the live module, whose buffers say which infinities are intended (see the module docstring); without
            it, the sidecar's record says so, else infinities and no NaN in a ``state_dict`` entry pass with a note.

    Returns:
        ``(result, checkpoint)``; ``checkpoint`` is ``None`` unless ``result.ok``. ``result.step`` is the file's
        ``global_step`` whenever it could be read, even when it fails for non-finite values.
    """
    reason, stale_note = _check_sidecar(path, require_sidecar=require_sidecar)
    if reason is not None:
        return VerifyResult(path, False, reason), None
    # A file whose sidecar is stale is on its own: where it fails, the reason says both.
    stale = ""
    if stale_note:
        name = os.path.basename(path) + SIDECAR_SUFFIX
        stale = f"sha256 does not match its sidecar {name} (the file was written again after it), and on its own: "
    try:
        checkpoint = load(path) if load is not None else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is a failed verification, whatever torch raises
        return VerifyResult(path, False, stale + _load_failure(err)), None
    step = checkpoint_step(checkpoint)
    try:
        bad = nonfinite_tensors(checkpoint)
        note = ""
        if bad:  # the incident path (or a mask): which infinities are intended
            sidecar = read_sidecar(path)
            intended = intended_infinities_of(checkpoint, sidecar.meta if sidecar else None, module)
            bad = nonfinite_tensors(checkpoint, intended.names)
            note = intended.note
    except RecursionError:  # loadable, but nested deeper than any checkpoint: made to crash a reader
        return VerifyResult(path, False, f"{stale}its contents nest too deep to be a checkpoint", step=step), None
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return VerifyResult(path, False, f"{stale}non-finite values in {', '.join(bad[:3])}{more}", step=step), None
    note = "; ".join(n for n in (stale_note, note) if n)
    return VerifyResult(path, True, note=note, step=step), checkpoint


def verify_checkpoint(path: str, *, require_sidecar: bool = True, module: nn.Module | None = None) -> VerifyResult:
    """Check a checkpoint file: sidecar checksum (zip CRC-32s without one), loadable with ``weights_only=True``, finite
    weights and optimizer state (intended infinities aside: ``module`` as for ``verify_and_load``). A directory is
    checked as a distributed checkpoint: its manifest, every listed file's size and sha256, no unlisted shard
    (``require_sidecar`` does not apply: a directory without a manifest fails).

    A file that fails only for want of a sidecar has its contents checked all the same, and the reason says both
    facts ("no checksum sidecar ...; its contents: non-finite values in state_dict.w"): an ordinary Lightning
    checkpoint with NaN weights is never reported as merely unsigned."""
    path = os.fspath(path)
    if os.path.isdir(path):
        reason = verify_directory(path)
        return VerifyResult(path, reason is None, reason or "", step=manifest_step(path))
    result = verify_and_load(path, require_sidecar=require_sidecar, module=module)[0]
    if result.ok or not require_sidecar or not os.path.isfile(path) or read_sidecar(path) is not None:
        return result
    contents = verify_and_load(path, require_sidecar=False, module=module)[0]
    found = contents.reason if not contents.ok else "they verify (zip CRC-32s, a weights-only load, finite)"
    return VerifyResult(path, False, f"{result.reason}; its contents: {found}", contents.note, contents.step)


def checkpoint_files(dirpath: str) -> list[str]:
    """The regular ``*.ckpt`` files of ``dirpath``, newest first (ties: the original name before the tag link)."""
    return checkpoint_candidates(dirpath, directories=False)


def checkpoint_candidates(dirpath: str, *, directories: bool = True) -> list[str]:
    """``checkpoint_files`` and (with ``directories``) the distributed checkpoint directories of ``dirpath``, newest
    first; a directory's time is its manifest's (when its save completed). Hidden entries (our temporary ones) and
    symlinks are left out."""
    if not os.path.isdir(dirpath):
        return []
    found: list[tuple[int, bool, str, str]] = []
    for entry in os.scandir(dirpath):
        if entry.name.endswith(".ckpt") and entry.is_file(follow_symlinks=False):
            found.append((entry.stat().st_mtime_ns, entry.name != LAST_GOOD_NAME, entry.name, entry.path))
        elif (
            directories
            and not entry.name.startswith(".")
            and entry.is_dir(follow_symlinks=False)
            and is_distributed_checkpoint(entry.path)
        ):
            found.append((written_ns(entry.path), True, entry.name, entry.path))
    return [path for *_, path in sorted(found, reverse=True)]


def last_good_checkpoint(
    dirpath: str,
    *,
    require_sidecar: bool = True,
    at_or_before_step: int | None = None,
    directories: bool = True,
    module: nn.Module | None = None,
    admit: Callable[[str, int], bool] | None = None,
) -> str | None:
    """The newest (by modification time) ``*.ckpt`` file or distributed checkpoint directory in ``dirpath`` that
    verifies, or ``None``.

    Symlinks are skipped (their targets are regular files of the directory). Every rank that calls this on the same
    directory gets the same answer. A directory counts when its manifest verifies (``verify_checkpoint``); its step
    is the manifest's.

    Args:
        dirpath: the checkpoint directory.
        require_sidecar: only files with a matching sha256 sidecar count.
        at_or_before_step: only Lightning checkpoints whose ``global_step`` is this step or earlier count (a file
            without a ``global_step`` never does): a rollback to step N must never "restore" a later state, such as
            the newest file of an abandoned run in the same directory.
        directories: consider distributed checkpoint directories too (``False``: files only, for a caller that
            loads the result with ``torch.load``).
        module: the live module, for intended infinities (``verify_and_load``).
        admit: ``admit(path, step)``: whether a verified Lightning checkpoint of that step may be chosen (a disk
            rollback admits only its run's own past: ``checkpointing/lineage.py``). A file without a step is not.

    Example::

        >>> ckpt = last_good_checkpoint("lightning_logs/version_0/checkpoints")
        >>> trainer.fit(model, ckpt_path=ckpt)
    """
    for path in checkpoint_candidates(os.fspath(dirpath), directories=directories):
        reason, step = verified_step(path, require_sidecar=require_sidecar, module=module)
        if reason is not None:
            continue
        if at_or_before_step is not None and (step is None or step > at_or_before_step):
            continue
        if admit is not None and (step is None or not admit(path, step)):
            continue
        return path
    return None


def verified_step(
    path: str, *, require_sidecar: bool = True, module: nn.Module | None = None
) -> tuple[str | None, int | None]:
    """``(why path fails verification, or None; its global_step, or None)``: a distributed checkpoint directory by
    its manifest (and the step it records), a file by ``verify_and_load`` (and ``checkpoint_step``)."""
    if os.path.isdir(path):
        reason = verify_directory(path)
        return reason, manifest_step(path) if reason is None else None
    result = verify_and_load(path, require_sidecar=require_sidecar, module=module)[0]
    return (None, result.step) if result.ok else (result.reason, None)


def checkpoint_step(checkpoint: object) -> int | None:
    """A loaded Lightning checkpoint's ``global_step``; ``None`` for any other layout."""
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        return None
    step = checkpoint.get("global_step")
    if isinstance(step, Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return step


_STEP_RE = re.compile(r"(?:^|[^A-Za-z0-9])step=(\d+)(?![0-9])")


def step_in_name(path: str) -> int | None:
    """The ``step=N`` of a checkpoint's file name (ModelCheckpoint's default ``epoch=E-step=S.ckpt``), or ``None``.

    The name is all there is to go by when the file itself cannot be read.
    """
    found = _STEP_RE.search(os.path.basename(path))
    return int(found.group(1)) if found else None


def _load_failure(err: Exception) -> str:
    text = str(err).strip()
    # torch's weights-only error opens with how to load the file unsafely (weights_only=False); never repeat that
    # advice: the part that says what failed follows "WeightsUnpickler error:".
    found = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\s*Check the documentation|$)", text, re.S)
    if found is not None:
        detail = " ".join(found.group(1).split())
    else:
        detail = (text.splitlines() or [""])[0].strip()
        if "weights_only" in detail and "False" in detail:
            detail = "weights-only unpickling failed"
    if "Unsupported global" in text:
        return (
            f"cannot be loaded with weights_only=True: {detail} (if the file is trusted and its hyperparameters hold "
            "custom types, allow-list them with torch.serialization.add_safe_globals([...]); "
            "torch.serialization.get_unsafe_globals_in_checkpoint(path) lists them)"
        )
    return (
        f"cannot be loaded: the file is corrupt, truncated or not a torch checkpoint ({type(err).__name__}: {detail})"
    )
