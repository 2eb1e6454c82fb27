"""How one checkpoint file gets written under CheckpointGuard: through a temporary name, or at the caller's path.

Lightning's own ``TorchCheckpointIO`` writes one file at the path it is given and nothing else, so for it (not for a
subclass that overrides ``save_checkpoint``, nor a patched one) the file is written under a temporary name in the
same directory, fsynced, hashed and renamed onto the target: a crash leaves the old file or the new one, whole. Any
other ``CheckpointIO`` is handed the caller's path and ``storage_options`` as they are (it may act on the name); the
file it wrote is hashed after an fsync, and its sidecar, removed before the write, is written only then, so a write
that does not finish never verifies. The ``nanguard-last-good.ckpt`` tag is a hard link to the newest good file; its
sidecar names that file, so that the tag goes when the project deletes it (``orphans.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_nanguard._files import hash_file
from lightning_nanguard.checkpointing.orphans import TAG_SOURCE_KEY
from lightning_nanguard.checkpointing.sidecar import LEGACY_SIDECAR_SUFFIX, remove_sidecars, sidecar_path, write_sidecar
from lightning_nanguard.checkpointing.tmp_files import tmp_name
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME

__all__ = ["tag", "write_at_path", "write_through_tmp", "writes_one_file"]

_TORCH_SAVE = TorchCheckpointIO.save_checkpoint


def writes_one_file(io: CheckpointIO) -> bool:
    """``io`` saves with Lightning's own ``TorchCheckpointIO.save_checkpoint`` (one file at the given path)."""
    return "save_checkpoint" not in vars(io) and getattr(type(io), "save_checkpoint", None) is _TORCH_SAVE


def write_through_tmp(
    io: CheckpointIO, checkpoint: dict[str, Any], target: str, storage_options: object, writing: set[str]
) -> str:
    """Write through a temporary name and rename it onto ``target``; returns the file's sha256."""
    tmp = tmp_name(target)
    writing.add(tmp)
    try:
        io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        digest = hash_file(tmp, fsync=True)[1]
        os.replace(tmp, target)
    finally:
        writing.discard(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return digest


def write_at_path(
    io: CheckpointIO, checkpoint: dict[str, Any], path: Any, target: str, storage_options: object
) -> str | None:
    """Hand ``io`` the caller's ``path``; the sha256 of the file it wrote at ``target``, or ``None`` when it wrote no
    new regular file there (a directory, another store, nothing: that save has no sidecar)."""
    old_sidecar = next((p for p in (sidecar_path(target), target + LEGACY_SIDECAR_SUFFIX) if os.path.isfile(p)), "")
    old_digest = _read_bytes(old_sidecar) if old_sidecar else None
    tag_path = os.path.join(os.path.dirname(os.path.abspath(target)), LAST_GOOD_NAME)
    if os.path.basename(target) != LAST_GOOD_NAME and _same_file(target, tag_path):
        os.remove(target)  # the tag keeps this content: an IO that rewrites the file in place cannot touch it
    before = _identity(target)
    remove_sidecars(target)  # an unfinished write never verifies against the old digest
    io.save_checkpoint(checkpoint, path, storage_options=storage_options)
    after = _identity(target)
    if after is None or after == before:
        if before is not None and old_digest is not None:  # untouched: its sidecar still vouches for it
            with open(old_sidecar, "wb") as f:
                f.write(old_digest)
        return None
    return hash_file(target, fsync=True)[1]


def tag(source: str, tag_path: str, digest: str, meta: dict[str, Any], writing: set[str]) -> None:
    """Point ``tag_path`` at ``source``'s content: a hard link (no extra disk), a copy where links are unsupported."""
    tmp = tmp_name(tag_path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    writing.add(tmp)
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
            hash_file(tmp, fsync=True)  # the copy's data on disk before the rename
        os.replace(tmp, tag_path)
    finally:
        writing.discard(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    # The source's name: once the project deletes that file, the tag is removed too (``orphans.remove_orphans``).
    write_sidecar(tag_path, digest=digest, meta={**meta, TAG_SOURCE_KEY: os.path.basename(source)})


def _identity(path: str) -> tuple[int, int, int, int] | None:
    """``(device, inode, size, mtime_ns)`` of the regular file ``path``, or ``None``."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if os.path.isfile(path) else None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None
