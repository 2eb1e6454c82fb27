"""The temporary files of checkpoint saves: their names, and the removal of those that killed saves left behind.

A save that nanguard writes itself (a file through Lightning's ``TorchCheckpointIO``, the
``nanguard-last-good.ckpt`` tag, a distributed checkpoint's directory) goes to ``.nanguard-<hash>.<pid>@<host>.tmp``
next to its target first and is renamed onto the target when complete; a sidecar is written through
``<name>.ckpt.checksum.tmp``. The temporary name holds a hash of the target's name, not the name itself: Lightning
reads the digits of every file whose name holds ``ckpt_`` as an HPC checkpoint version, and a temporary
``.hpc_ckpt_3.ckpt.4242@host.tmp`` would read as version 34242. A save that is killed (preemption, the OOM killer)
leaves its temporary file behind; a later save or run removes it, once its writer is known to be gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import time

from lightning_nanguard.checkpointing.sidecar import LEGACY_SIDECAR_SUFFIX, SIDECAR_SUFFIX

__all__ = ["STALE_TMP_SECONDS", "host_name", "remove_stale_tmp_files", "tmp_name"]

# A temporary file of ours: ".nanguard-<hash>.<pid>@<host>.tmp", or the older ".<name>.<pid>@<host>.tmp" and
# ".<name>.ckpt.<pid>.tmp" (no host), or "<name>.ckpt.checksum.tmp" / "<name>.ckpt.sha256.tmp" (a sidecar).
_TMP_RE = re.compile(
    r"^\.(?P<base>.+)\.(?P<pid>\d+)@(?P<host>[^/@]+)\.tmp$|^\.(?P<legacy>.+\.ckpt)\.(?P<lpid>\d+)\.tmp$"
)
_SIDECAR_TMP_RE = re.compile(
    r"^(?P<base>.+\.ckpt)(?:" + re.escape(SIDECAR_SUFFIX) + "|" + re.escape(LEGACY_SIDECAR_SUFFIX) + r")\.tmp$"
)
# A temporary file from another host (or of unknown origin) is left alone until it is this old: a save in progress
# elsewhere is never touched.
STALE_TMP_SECONDS = 3600.0


def host_name() -> str:
    """This host's name as it appears in a temporary file's name (characters outside ``[A-Za-z0-9_.-]`` as ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "localhost"


def tmp_name(target: str) -> str:
    """``.nanguard-<hash of the name>.<pid>@<host>.tmp`` next to ``target``: hidden, not ``*.ckpt``, one per target,
    traceable to its writer, and without the target's name (whose digits Lightning could read as a version)."""
    name = os.path.basename(target)
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(os.path.dirname(os.path.abspath(target)), f".nanguard-{digest}.{os.getpid()}@{host_name()}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell: treat as alive
    return True


def remove_stale_tmp_files(directory: str, *, in_use: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Remove the temporary files that killed saves left in ``directory``; returns the removed paths.

    Only our own names are touched (``.nanguard-<hash>.<pid>@<host>.tmp``, the older ``.<name>.ckpt.<pid>[@<host>].tmp``,
    ``<name>.ckpt.checksum.tmp`` and ``<name>.ckpt.sha256.tmp``; also a distributed checkpoint's temporary directory
    of the same names), and only when not in use:
    written by this process but not being written now, or by a process of this host that no longer runs, or
    (another host's, or a sidecar's) last modified more than ``STALE_TMP_SECONDS`` ago.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    host, me, now = host_name(), os.getpid(), time.time()
    for entry in entries:
        match = _TMP_RE.match(entry.name)
        sidecar = _SIDECAR_TMP_RE.match(entry.name) if match is None else None
        if (match is None and sidecar is None) or entry.path in in_use:
            continue
        try:
            is_dir = match is not None and entry.is_dir(follow_symlinks=False)
            if not is_dir and not entry.is_file(follow_symlinks=False):
                continue
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        stale = age > STALE_TMP_SECONDS
        if match is not None and not stale and match.group("host") in (None, host):
            pid = int(match.group("pid") or match.group("lpid"))
            # No host in the name (the legacy name): its pid is checked here as the best guess.
            stale = pid == me or not _pid_alive(pid)
        if stale:
            with contextlib.suppress(OSError):
                if is_dir:
                    shutil.rmtree(entry.path)
                else:
                    os.remove(entry.path)
                removed.append(entry.path)
    return removed
