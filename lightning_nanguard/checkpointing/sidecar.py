"""The checksum sidecar next to a checkpoint file: its name, its digest, and what nanguard records beside the digest.

A checkpoint ``X.ckpt`` gets ``X.ckpt.checksum``, in ``sha256sum`` format (``sha256sum -c X.ckpt.checksum`` works)::

    3f2a...e9  X.ckpt
    # nanguard {"intended_infinities": ["causal_mask"], "lineage": [["4b1f0c2a9d3e", 0]], "step": 64}

The second line is a comment to ``sha256sum`` and nanguard's record of the file, all of it known when it was saved:
``step`` (the checkpoint's ``global_step``: what a fallback compares with even when the file no longer loads),
``intended_infinities`` (the ``state_dict`` entries that held infinities by design when it was saved, such as an
attention mask of -inf) and ``lineage`` (the runs the file descends from, ``checkpointing/lineage.py``). Nothing is added
to the checkpoint itself: it loads with ``torch.load(weights_only=True)`` exactly as Lightning wrote it.

The suffix has no digit and the name ends in neither ``.ckpt`` nor ``.tmp``: Lightning reads the digits of every file
whose name holds ``ckpt_`` as an HPC checkpoint version (``hpc_ckpt_33.ckpt.sha256`` would read as version 33256),
and ``ModelCheckpoint`` lists ``*.ckpt``. Sidecars named ``X.ckpt.sha256`` (written by earlier versions) are still
read; writing a sidecar removes that older one.

A sidecar is *stale* when its file was written again after it (a session with plain Lightning rewrote ``last.ckpt``,
a script saved over the file): the file no longer matches it, was modified after it was written, and is whole (its
zip members pass the CRC-32s torch's format stores). It vouches for a file that is gone, so neither its digest nor
its record says anything about the file there now (``Sidecar.stale``, ``meta`` empty). A file that does not match
and did not change since its sidecar, or whose zip members fail their CRC-32s (cut short, bytes changed in place), is
damaged, not stale: the sidecar's record (its step) still describes what the file was.

No Lightning, no torch: plain files.
"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard._files import hash_file, write_text_atomic
from lightning_nanguard.checkpointing.manifest import read_manifest

__all__ = [
    "LEGACY_SIDECAR_SUFFIX",
    "SIDECAR_SUFFIX",
    "Sidecar",
    "check_zip_crc",
    "existing_sidecar",
    "meta_of",
    "read_sidecar",
    "remove_sidecars",
    "sidecar_path",
    "write_sidecar",
]

SIDECAR_SUFFIX = ".checksum"
LEGACY_SIDECAR_SUFFIX = ".sha256"
_META_PREFIX = "# nanguard "


@dataclass(frozen=True)
class Sidecar:
    """A sidecar as read: the digest it vouches for (``""`` when it holds none) and nanguard's record (may be empty)."""

    path: str
    digest: str
    meta: dict[str, Any] = field(default_factory=dict)
    stale: bool = False  # the file was written again after this sidecar, which no longer matches it


def sidecar_path(path: str) -> str:
    """Where ``path``'s sidecar is written."""
    return path + SIDECAR_SUFFIX


def existing_sidecar(path: str) -> str | None:
    """``path``'s sidecar if one exists (the current name first, then the older ``.sha256``); for a symlink without
    one of its own (ModelCheckpoint's ``save_last="link"``), its target's."""
    for base in (path, os.path.realpath(path)) if os.path.islink(path) else (path,):
        for suffix in (SIDECAR_SUFFIX, LEGACY_SIDECAR_SUFFIX):
            if os.path.isfile(base + suffix):
                return base + suffix
    return None


def read_sidecar(path: str) -> Sidecar | None:
    """``path``'s sidecar, read, or ``None`` when it has none. Whatever its bytes: an unreadable record reads as no
    record, and a first field that is no sha256 (64 hexadecimal digits) as a digest that matches nothing."""
    found = existing_sidecar(path)
    if found is None:
        return None
    try:
        with open(found, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []  # no digest: "checksum sidecar ... holds no sha256"
    fields = lines[0].split() if lines else []
    meta: dict[str, Any] = {}
    for line in lines[1:]:
        if line.startswith(_META_PREFIX):
            with contextlib.suppress(ValueError, RecursionError):
                loaded = json.loads(line[len(_META_PREFIX) :])
                meta = loaded if isinstance(loaded, dict) else {}
    digest = fields[0].lower() if fields else ""
    if digest and _rewritten_since(path, found, digest):
        return Sidecar(found, digest, {}, stale=True)
    return Sidecar(found, digest, meta)


# The verdict on the few files whose staleness was asked about, by their identity on disk (a rewrite changes the
# inode, size, mtime or ctime) and their sidecar's: a resume asks several times about the file it resumes from.
_STALE: dict[tuple[int, ...], bool] = {}


def meta_of(path: str) -> dict[str, Any]:
    """nanguard's record of a checkpoint: a file's sidecar comment, a directory's manifest (``{}`` without one)."""
    if os.path.isdir(path):
        manifest, _ = read_manifest(path)
        return manifest or {}
    sidecar = read_sidecar(path) if os.path.isfile(path) else None
    return sidecar.meta if sidecar is not None else {}


def _rewritten_since(path: str, sidecar: str, digest: str) -> bool:
    """``path`` was modified at or after its sidecar was written (which is written after its file is complete, so a
    file of the sidecar's own save is older), its sha256 is not the sidecar's ``digest``, and it is whole."""
    try:
        st, sc = os.stat(path), os.stat(sidecar)
    except OSError:
        return False
    if st.st_mtime_ns < sc.st_mtime_ns:
        return False
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, sc.st_ino, sc.st_mtime_ns)
    stale = _STALE.get(identity)
    if stale is None:
        stale = hash_file(path)[1] != digest and check_zip_crc(path) is None
        if len(_STALE) >= 16:
            _STALE.clear()
        _STALE[identity] = stale
    return stale


def write_sidecar(path: str, *, digest: str | None = None, meta: dict[str, Any] | None = None) -> str:
    """Write ``path``'s sidecar atomically (temporary file, fsync, rename), remove an older ``.sha256`` one; returns
    the digest.

    Args:
        path: the checkpoint file.
        digest: its sha256 when the caller already has it (saves reading the file again).
        meta: nanguard's record of the file (JSON-serializable), written as the comment line.
    """
    if digest is None:
        digest = hash_file(path)[1]
    text = f"{digest}  {os.path.basename(path)}\n"
    if meta:
        text += _META_PREFIX + json.dumps(meta, sort_keys=True, separators=(", ", ": ")) + "\n"
    write_text_atomic(sidecar_path(path), text)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + LEGACY_SIDECAR_SUFFIX)
    return digest


def remove_sidecars(path: str) -> None:
    """Remove ``path``'s sidecars (both names), where they exist."""
    for suffix in (SIDECAR_SUFFIX, LEGACY_SIDECAR_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + suffix)


def check_zip_crc(path: str) -> str | None:
    """Why ``path``'s zip members fail their stored CRC-32, or ``None`` when they pass (or it is not a zip file).

    torch's default format is a zip archive with a CRC-32 per member (``torch.load`` does not check them), so a
    flipped bit inside a tensor's bytes is found without a sidecar. The legacy pickle format (``torch.save(...,
    _use_new_zipfile_serialization=False)``) has no checksum at all and passes.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        return None  # legacy format: nothing to check against (its contents are still loaded and checked)
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return f"the file is corrupt or truncated: its zip structure cannot be read ({type(err).__name__}: {err})"
    if bad is not None:
        return f"the file is corrupt: CRC-32 mismatch in zip member {bad!r} (bytes changed after it was written)"
    return None
