"""Durable file writes and the one sha256 of a file that sidecars, manifests and saves all use.

No Lightning, no torch: plain files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import fsspec

__all__ = ["fsync_dir", "hash_file", "is_local_path", "write_text_atomic"]

_BLOCK = 1 << 20


def hash_file(path: str, *, fsync: bool = False) -> tuple[int, str]:
    """``(size, sha256 hex digest)`` of ``path``; with ``fsync`` the file's data is flushed to disk too (it was just
    written, and is about to be published)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())
        while block := f.read(_BLOCK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through ``path + ".tmp"`` (written, fsynced, renamed): a reader sees the old file or
    the whole new one, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(directory: str) -> None:
    """Make the renames in ``directory`` durable (POSIX); a no-op where a directory cannot be opened (Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def is_local_path(path: str) -> bool:
    """``path`` is on the local filesystem (no ``s3://``-like protocol): where checksums and renames apply."""
    return bool(fsspec.utils.get_protocol(path) == "file")
