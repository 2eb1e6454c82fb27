"""A CheckpointIO wrapper: atomic, checksummed, finite-only saves; verified loads with an optional fallback.

Lightning calls ``save_checkpoint`` on global rank 0 only and ``load_checkpoint`` on every rank that restores. Every
rank that loads reads the same file and runs the same checks, so every rank reaches the same verdict without a
collective. Everything else (removal, teardown, the actual serialization) is delegated to the wrapped IO.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_nanguard.checkpoints import (
    LAST_GOOD_NAME,
    SIDECAR_SUFFIX,
    checkpoint_files,
    last_good_checkpoint,
    nonfinite_tensors,
    verify_and_load,
    write_sidecar,
)
from lightning_nanguard.exceptions import CheckpointVerificationError

__all__ = ["CheckpointEvent", "VerifyingCheckpointIO"]

EventKind = Literal["saved", "refused_save", "loaded", "refused_load", "fallback", "unverified"]


@dataclass(frozen=True)
class CheckpointEvent:
    """What the wrapper did with one file, for the callback to report (``path``: the file Lightning asked for)."""

    kind: EventKind
    path: str
    reason: str = ""
    substitute: str = ""  # for "fallback": the file actually loaded
    tensors: tuple[str, ...] = ()  # for "refused_save": the non-finite tensors


class VerifyingCheckpointIO(CheckpointIO):
    """Wrap a ``CheckpointIO`` so that no non-finite or half-written checkpoint is ever taken for a good one.

    Save: refuse a checkpoint whose weights or optimizer state hold NaN/inf (nothing is written); otherwise let the
    wrapped IO write a temporary file in the same directory, fsync it, hash it, ``os.replace`` it onto the target,
    then write the sha256 sidecar; then point the directory's ``nanguard-last-good.ckpt`` hard link at it.
    A crash at any point leaves either the old verified file or a file that fails verification.

    Load: verify the sidecar checksum, load with ``weights_only=True`` (unless the caller passed ``False``), check
    finiteness; on failure raise ``CheckpointVerificationError`` or, with ``fallback``, load the newest verified
    checkpoint of the same directory instead.

    Args:
        checkpoint_io: the IO to wrap (Lightning's ``TorchCheckpointIO`` or a user plugin that writes one file).
        require_sidecar: refuse to load a file without a sidecar.
        fallback: on a failed load, use the newest verified checkpoint of the same directory.
        tag_last_good: keep the ``nanguard-last-good.ckpt`` hard link (a copy where links are unsupported).
        listener: called with a ``CheckpointEvent`` after each save/load decision (and before a raise).
    """

    def __init__(
        self,
        checkpoint_io: CheckpointIO,
        *,
        require_sidecar: bool = True,
        fallback: bool = False,
        tag_last_good: bool = True,
        listener: Callable[[CheckpointEvent], None] | None = None,
    ) -> None:
        self.checkpoint_io = checkpoint_io
        self.require_sidecar = require_sidecar
        self.fallback = fallback
        self.tag_last_good = tag_last_good
        self.listener = listener
        self._told_remote = False

    # ------------------------------------------------------------------ save
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = str(path)
        bad = nonfinite_tensors(checkpoint)
        if bad:
            self._notify(
                CheckpointEvent("refused_save", target, f"non-finite values in {len(bad)} tensors", tensors=tuple(bad))
            )
            return
        if not _is_local_file_protocol(target):
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self._tell_remote(target, "not a local file: written without a sidecar (checksums are local-only)")
            return
        directory = os.path.dirname(os.path.abspath(target))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.tmp")
        try:
            self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
            if not os.path.isfile(tmp):
                raise CheckpointVerificationError(
                    f"nanguard: {type(self.checkpoint_io).__name__} did not write a single file for {target}; "
                    "CheckpointGuard supports file checkpoints only. Remove CheckpointGuard or use TorchCheckpointIO."
                )
            digest = _fsync_and_hash(tmp)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        _fsync_dir(directory)
        # The sidecar comes last: until it is written, the new file fails verification (missing or stale digest).
        write_sidecar(target, digest=digest)
        if self.tag_last_good and os.path.basename(target) != LAST_GOOD_NAME:
            _tag(target, os.path.join(directory, LAST_GOOD_NAME), digest)
        self._notify(CheckpointEvent("saved", target))

    # ------------------------------------------------------------------ load
    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        requested = str(path)
        kwargs: dict[str, Any] = {"weights_only": True if weights_only is None else weights_only}
        if map_location is not None:  # otherwise keep the wrapped IO's own default
            kwargs["map_location"] = map_location

        def load(p: str) -> Any:
            return self.checkpoint_io.load_checkpoint(p, **kwargs)

        if not _is_local_file_protocol(requested):
            return self._load_remote(requested, load)
        result, checkpoint = verify_and_load(requested, require_sidecar=self.require_sidecar, load=load)
        if result.ok:
            self._notify(CheckpointEvent("loaded", requested))
            return checkpoint
        if self.fallback:
            for candidate in checkpoint_files(os.path.dirname(os.path.abspath(requested))):
                # Only the requested name is skipped: a hard link to the same content (the tag) has its own
                # sidecar, and re-verifying it is what lets a file that merely lost its sidecar fall back to its tag.
                if os.path.abspath(candidate) == os.path.abspath(requested):
                    continue
                found, checkpoint = verify_and_load(candidate, require_sidecar=self.require_sidecar, load=load)
                if found.ok:
                    self._notify(CheckpointEvent("fallback", requested, result.reason, substitute=candidate))
                    return checkpoint
        message = self._load_error(requested, result.reason)
        self._notify(CheckpointEvent("refused_load", requested, result.reason))
        raise CheckpointVerificationError(message)

    # ------------------------------------------------------------------ delegated
    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.checkpoint_io.remove_checkpoint(path)
        if _is_local_file_protocol(str(path)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(str(path) + SIDECAR_SUFFIX)

    @override
    def teardown(self) -> None:
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ internals
    def _notify(self, event: CheckpointEvent) -> None:
        if self.listener is not None:
            self.listener(event)

    def _tell_remote(self, path: str, reason: str) -> None:
        if not self._told_remote:  # once per wrapper: a warning per save would drown the log
            self._told_remote = True
            self._notify(CheckpointEvent("unverified", path, reason))

    def _load_remote(self, path: str, load: Callable[[str], Any]) -> Any:
        checkpoint = load(path)
        bad = nonfinite_tensors(checkpoint) if isinstance(checkpoint, dict) else []
        if bad:
            reason = f"non-finite values in {', '.join(bad[:3])}"
            self._notify(CheckpointEvent("refused_load", path, reason))
            raise CheckpointVerificationError(self._load_error(path, reason))
        self._tell_remote(path, "not a local file: finiteness checked, checksum not (checksums are local-only)")
        return checkpoint

    def _load_error(self, path: str, reason: str) -> str:
        directory = os.path.dirname(os.path.abspath(path))
        tries: list[str] = []
        good = (
            last_good_checkpoint(directory, require_sidecar=self.require_sidecar)
            if _is_local_file_protocol(path)
            else None
        )
        if good is not None and os.path.abspath(good) != os.path.abspath(path):
            tries.append(
                f"resume from the newest verified checkpoint of that directory, {good} (or pass "
                "CheckpointGuard(fallback=True) to do so automatically)"
            )
        elif self.fallback:
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


def _fsync_and_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
        os.fsync(f.fileno())
    return h.hexdigest()


def _fsync_dir(directory: str) -> None:
    # Makes the rename durable on POSIX; directories cannot be opened this way on Windows.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tag(source: str, tag: str, digest: str) -> None:
    """Point ``tag`` at ``source``'s content: a hard link (no extra disk), a copy where links are unsupported."""
    tmp = os.path.join(os.path.dirname(tag), f".{os.path.basename(tag)}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
        _fsync_and_hash(tmp)
    os.replace(tmp, tag)
    write_sidecar(tag, digest=digest)


def _is_local_file_protocol(path: str) -> bool:
    return bool(fsspec.utils.get_protocol(path) == "file")
