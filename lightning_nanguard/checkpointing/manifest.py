"""Distributed (directory) checkpoints: the ``nanguard-manifest.json`` that lists and checksums every file.

``ModelParallelStrategy(save_distributed_checkpoint=True)`` saves a checkpoint as a directory
(``torch.distributed.checkpoint``: one ``__{rank}_{i}.distcp`` per rank and writer thread, ``.metadata``, Lightning's
``meta.pt``). CheckpointGuard adds ``nanguard-manifest.json``::

    {"format": "nanguard-distributed-checkpoint", "version": 1, "step": 4, "epoch": 0, "world_size": 2,
     "finite": true, "files": {"__0_0.distcp": {"size": 1234, "sha256": "..."}, ".metadata": {...}, ...},
     "intended_infinities": [], "lineage": [["4b1f0c2a9d3e", 0]]}

A directory is *verified* when its manifest reads, says ``finite`` (the state was checked on every rank before the
save), lists every file with its size and sha256 and every listed file matches, and no ``*.distcp`` or ``.metadata``
file is unlisted (a shard left by another save would be read by the load). The tensors are not loaded: their
finiteness was checked, collectively, before they were written, and the hashes say the bytes are those bytes.

No Lightning import and no collective here: usable from any script (``nanguard verify DIR``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

from lightning_nanguard._files import hash_file, write_text_atomic
from lightning_nanguard.exceptions import brief

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "directory_files",
    "files_of_rank",
    "is_distributed_checkpoint",
    "manifest_step",
    "read_manifest",
    "recorded_int",
    "verify_directory",
    "write_manifest",
    "written_ns",
]

MANIFEST_NAME = "nanguard-manifest.json"
MANIFEST_FORMAT = "nanguard-distributed-checkpoint"
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
_DCP_METADATA = ".metadata"


def directory_files(dirpath: str) -> list[str]:
    """Every regular file under ``dirpath`` as a relative POSIX path, sorted, the manifest (and its temporary
    file) excluded."""
    found: list[str] = []
    for root, dirs, files in os.walk(dirpath):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), dirpath).replace(os.sep, "/")
            if rel in (MANIFEST_NAME, MANIFEST_NAME + ".tmp"):
                continue
            if os.path.isfile(os.path.join(root, name)) and not os.path.islink(os.path.join(root, name)):
                found.append(rel)
    return sorted(found)


def files_of_rank(names: list[str], rank: int) -> list[str]:
    """The files ``rank`` hashes: its own shards (``__{rank}_*.distcp``); rank 0 also every other file
    (``.metadata`` and ``meta.pt``, which it wrote). Every file is hashed by exactly one rank."""
    mine: list[str] = []
    for name in names:
        shard = _SHARD_RE.match(os.path.basename(name))
        owner = int(shard.group(1)) if shard is not None and "/" not in name else 0
        if owner == rank:
            mine.append(name)
    return mine


def write_manifest(
    dirpath: str,
    files: dict[str, dict[str, Any]],
    *,
    step: int | None,
    epoch: int | None,
    world_size: int,
    record: dict[str, Any] | None = None,
) -> str:
    """Write ``dirpath/nanguard-manifest.json`` atomically (temporary file, fsync, rename); returns its path.

    Args:
        dirpath: the checkpoint directory (still the temporary one: it is published after this).
        files: relative path -> ``{"size": int, "sha256": str}`` for every file of the directory.
        step: the trainer's ``global_step`` at the save.
        epoch: the trainer's ``current_epoch`` at the save.
        world_size: the number of ranks that wrote the shards.
        record: nanguard's record of the checkpoint, as in a file's sidecar (``intended_infinities``, ``lineage``).
    """
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": 1,
        "step": step,
        "epoch": epoch,
        "world_size": world_size,
        "finite": True,  # only a state verified finite on every rank is ever saved
        "files": {name: dict(files[name]) for name in sorted(files)},
    }
    for key, value in (record or {}).items():
        manifest.setdefault(key, value)
    path = os.path.join(dirpath, MANIFEST_NAME)
    write_text_atomic(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(dirpath: str) -> tuple[dict[str, Any] | None, str]:
    """``(manifest, "")``, or ``(None, why it cannot be used)``."""
    path = os.path.join(dirpath, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None, (
            f"no {MANIFEST_NAME} (the directory was not written by CheckpointGuard, or its save was interrupted "
            "before it was published)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError, RecursionError) as err:
        return None, f"{MANIFEST_NAME} cannot be read ({type(err).__name__}: {str(err)[:200]})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None, f"{MANIFEST_NAME} is not a nanguard manifest (format is not {MANIFEST_FORMAT!r})"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None, f"{MANIFEST_NAME} lists no files"
    for name, entry in files.items():
        if (
            not _inside_name(name)
            or not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            return None, f"{MANIFEST_NAME} has a malformed entry for {brief(name)}"
    return manifest, ""


def _inside_name(name: str) -> bool:
    """A listed file's name is relative and stays inside the directory (no "..", no absolute path)."""
    parts = name.split("/")
    return bool(name) and not name.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0]


def verify_directory(dirpath: str) -> str | None:
    """Why the distributed checkpoint ``dirpath`` fails verification, or ``None`` when it passes (see the module)."""
    if not os.path.isdir(dirpath):
        return "directory does not exist"
    manifest, reason = read_manifest(dirpath)
    if manifest is None:
        return reason
    if manifest.get("finite") is not True:
        return f"{MANIFEST_NAME} does not record the state as finite"
    listed: dict[str, dict[str, Any]] = manifest["files"]
    present = set(directory_files(dirpath))
    unlisted = sorted(
        name for name in present - set(listed) if name.endswith(".distcp") or os.path.basename(name) == _DCP_METADATA
    )
    if unlisted:
        shown = ", ".join(unlisted[:3]) + (" ..." if len(unlisted) > 3 else "")
        return f"files not in {MANIFEST_NAME}: {shown} (left by another save, or added after this one)"
    for name, entry in sorted(listed.items()):
        path = os.path.join(dirpath, *name.split("/"))
        if name not in present:
            return f"{name} is listed in {MANIFEST_NAME} but missing"
        size = os.path.getsize(path)
        if size != entry["size"]:
            return f"{name} is {size} bytes, {MANIFEST_NAME} says {entry['size']} (truncated or modified)"
        if hash_file(path)[1] != entry["sha256"].lower():
            return f"sha256 of {name} does not match {MANIFEST_NAME} (the file is corrupt or was modified)"
    return None


def recorded_int(value: object) -> int | None:
    """``value`` when it is an ``int`` (a step in a manifest or a sidecar's record), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def manifest_step(dirpath: str) -> int | None:
    """The ``step`` a directory's manifest records, or ``None``."""
    manifest, _ = read_manifest(dirpath)
    return None if manifest is None else recorded_int(manifest.get("step"))


def is_distributed_checkpoint(path: str) -> bool:
    """``path`` is a directory that holds a distributed checkpoint (a nanguard manifest or DCP's ``.metadata``)."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, MANIFEST_NAME)) or os.path.isfile(os.path.join(path, _DCP_METADATA))
    )


def written_ns(path: str) -> int:
    """When a checkpoint was completed: a directory's manifest's mtime (else the directory's), a file's mtime."""
    if os.path.isdir(path):
        with contextlib.suppress(OSError):
            return os.stat(os.path.join(path, MANIFEST_NAME)).st_mtime_ns
    return os.stat(path).st_mtime_ns
