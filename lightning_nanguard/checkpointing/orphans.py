"""What a checkpoint deleted by the project leaves behind: its sidecar, and the tag that shares its bytes.

A project that deletes its own checkpoint (``os.remove``, a cleanup script, a retention of its own) removes the file
but not nanguard's ``<file>.checksum`` beside it, and not ``nanguard-last-good.ckpt``, a hard link that keeps the
deleted file's bytes on disk for as long as it exists. ``remove_orphans`` removes both: a sidecar whose file is gone,
and the tag when the file it was made from is gone (its sidecar records that file's name, ``tag_of``; a tag of an
older version, with no such record, when no other name shares its bytes and no file of the directory has its size,
which a copy made where links are unsupported would have). CheckpointGuard calls it at each save into a directory
and at train start, on global rank 0 (the rank that writes). The tag is a verified state only while its source's
name holds it; the next good save makes a new one.
"""

from __future__ import annotations

import contextlib
import os

from lightning_nanguard.checkpointing.sidecar import (
    LEGACY_SIDECAR_SUFFIX,
    SIDECAR_SUFFIX,
    meta_of,
    remove_sidecars,
)
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME

__all__ = ["TAG_SOURCE_KEY", "remove_orphans"]

# The key of the tag's sidecar record that names the file the tag was made from (a name in the same directory).
TAG_SOURCE_KEY = "tag_of"


def remove_orphans(directory: str) -> list[str]:
    """Remove ``directory``'s sidecars whose checkpoint is gone and its tag when the tag's source is gone; returns the
    removed paths."""
    removed: list[str] = []
    try:
        entries = {entry.name: entry for entry in os.scandir(directory)}
    except OSError:
        return removed
    for name, entry in entries.items():
        for suffix in (SIDECAR_SUFFIX, LEGACY_SIDECAR_SUFFIX):
            if name.endswith(suffix) and name[: -len(suffix)] not in entries and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.remove(entry.path)
                    removed.append(entry.path)
    tag = entries.get(LAST_GOOD_NAME)
    if tag is not None and _tag_orphaned(tag, entries):
        with contextlib.suppress(OSError):
            os.remove(tag.path)
            removed.append(tag.path)
        remove_sidecars(tag.path)
    return removed


def _tag_orphaned(tag: os.DirEntry[str], entries: dict[str, os.DirEntry[str]]) -> bool:
    try:
        st = tag.stat(follow_symlinks=False)
    except OSError:
        return False
    source = meta_of(tag.path).get(TAG_SOURCE_KEY)
    if isinstance(source, str) and source:
        return source not in entries
    # No record (a tag of an older version): orphaned when no other name shares its bytes and no file could be the
    # source of a copy.
    if st.st_nlink > 1:
        return False
    for name, entry in entries.items():
        if name != LAST_GOOD_NAME and name.endswith(".ckpt"):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.stat().st_size == st.st_size:
                    return False
    return True
