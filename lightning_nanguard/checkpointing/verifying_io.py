"""A CheckpointIO wrapper: checksummed, finite-only saves at the caller's path; verified loads with an optional fallback.

Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only and ``load_checkpoint`` on every
rank that restores. Every rank that loads reads the same file (a shared filesystem, as Lightning's own resume assumes)
and runs the same checks, so every rank reaches the same verdict without a collective. Nothing here feeds a training
decision: a refused save is rank 0's alone and is only reported. The actual serialization is delegated to the
wrapped IO.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Collection, Sequence
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch import nn
from typing_extensions import override

from lightning_nanguard._files import fsync_dir, is_local_path
from lightning_nanguard.checkpointing.events import CheckpointEvent, load_error
from lightning_nanguard.checkpointing.fallback import FallbackBound, fallback_bound, find_fallback
from lightning_nanguard.checkpointing.lineage import Lineage, lineage_of
from lightning_nanguard.checkpointing.orphans import remove_orphans
from lightning_nanguard.checkpointing.sidecar import meta_of, remove_sidecars
from lightning_nanguard.checkpointing.tmp_files import remove_stale_tmp_files
from lightning_nanguard.checkpointing.verify import (
    LAST_GOOD_NAME,
    checkpoint_files,
    checkpoint_step,
    nonfinite_tensors,
    verify_and_load,
    write_sidecar,
)
from lightning_nanguard.checkpointing.write import tag, write_at_path, write_through_tmp, writes_one_file
from lightning_nanguard.exceptions import CheckpointVerificationError

__all__ = ["VerifyingCheckpointIO"]


class VerifyingCheckpointIO(CheckpointIO):
    """Wrap a ``CheckpointIO`` so that no non-finite or half-written checkpoint is ever taken for a good one.

    Save: refuse a checkpoint whose weights or optimizer state hold NaN/inf (intended infinities aside: ``intended``)
    and write nothing. Otherwise:

    * Lightning's own ``TorchCheckpointIO`` writes into a temporary file in the same directory, which is fsynced,
      hashed and renamed onto the target (a crash leaves the old file or the new one, whole);
    * any other ``CheckpointIO`` (a plugin, a subclass that overrides ``save_checkpoint``) is handed the caller's path
      and ``storage_options`` unchanged, after the target's old sidecar is removed (and the target's name, when the
      tag shares its content, so that a writer that rewrites files in place cannot overwrite the tag); the file it
      wrote is then fsynced and hashed. An IO that writes no regular file at that path (a directory, another
      store) is told about once: that checkpoint has no sidecar.

    Then the sidecar (``checkpointing/sidecar.py``: the digest and the record: step, intended infinities, lineage) and
    the directory's ``nanguard-last-good.ckpt`` hard link. The first save into a directory removes the temporary
    files earlier killed saves left there (ours only, and only when not in use); every save removes the sidecars of
    checkpoints the project deleted, and the tag when its source is one of them (``orphans.py``).

    Retention: after a refused save, ``remove_checkpoint`` in that directory is deferred until a finite checkpoint is
    written there again, so ModelCheckpoint's top-k retention (which believes the refused file exists) never deletes
    the last good checkpoint. The deferred removals are carried out after the next good save.

    Load: a missing file raises ``FileNotFoundError`` (as Lightning does). Otherwise verify the sidecar checksum (the
    zip CRC-32s without one), load with ``weights_only=True`` (unless the caller passed ``False`` for the file it
    named), check finiteness (intended infinities aside: ``live_module``); on failure raise
    ``CheckpointVerificationError`` or, with ``fallback``, load a verified checkpoint of the same directory instead
    (``checkpointing/fallback.py``: never of a later step than the requested file's, of its lineage's past), always with
    ``weights_only=True``, whatever the caller allowed for its own file.

    Args:
        checkpoint_io: the IO to wrap (Lightning's ``TorchCheckpointIO`` or a user plugin).
        require_sidecar: refuse to load a file without a sidecar.
        fallback: on a failed load, use a verified checkpoint of the same directory.
        tag_last_good: keep the ``nanguard-last-good.ckpt`` hard link (a copy where links are unsupported).
        listener: called with a ``CheckpointEvent`` after each save/load decision (and before a raise).

    Attributes set by CheckpointGuard (``None`` when used alone):
        intended: the buffer names whose infinities are intended now (recorded at each save).
        live_module: the module a load is for (its own buffers say which infinities in a checkpoint are intended).
        lineage: the run's lineage (``checkpointing/lineage.py``), recorded at each save; ``track_lineage``: the next
            load is a resume, which extends it.
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
        self.intended: Callable[[], Collection[str]] | None = None
        self.live_module: Callable[[], nn.Module | None] | None = None
        self.lineage: Lineage | None = None
        self.track_lineage = False
        self._told: set[str] = set()  # the kinds of "unverified" notices already given (once each)
        self._cleaned: set[str] = set()  # directories whose stale temporary files were removed
        self._writing: set[str] = set()  # temporary files this process is writing now
        self._newest: dict[str, str] = {}  # directory -> the newest good checkpoint written there by this wrapper
        self._refused: set[str] = set()  # directories whose latest save was refused
        self._deferred: dict[str, list[str]] = {}  # directory -> removals deferred since that refusal

    # ------------------------------------------------------------------ save
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        if _is_spawn_transfer(target):
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        local = is_local_path(target)
        directory = os.path.dirname(os.path.abspath(target)) if local else ""
        intended = sorted(self.intended()) if self.intended is not None else None
        bad = nonfinite_tensors(checkpoint, intended or ())
        if bad:
            if local:
                self._refused.add(directory)
            kept = self._newest_good(directory) if local else ""
            self.notify(
                CheckpointEvent(
                    "refused_save",
                    target,
                    f"non-finite values in {len(bad)} tensors",
                    tensors=tuple(bad),
                    kept=kept,
                )
            )
            return
        if not local:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            self._tell("remote", target, "not a local file: written without a sidecar (checksums are local-only)")
            return
        os.makedirs(directory, exist_ok=True)
        if directory not in self._cleaned:
            self._cleaned.add(directory)
            remove_stale_tmp_files(directory, in_use=self._writing)
        remove_orphans(directory)  # what checkpoints the project deleted since left: sidecars, a tag of their bytes
        if writes_one_file(self.checkpoint_io):
            digest: str | None = write_through_tmp(
                self.checkpoint_io, checkpoint, target, storage_options, self._writing
            )
        else:
            digest = write_at_path(self.checkpoint_io, checkpoint, path, target, storage_options)
        if digest is None:
            name = type(self.checkpoint_io).__name__
            self._tell("not_a_file", target, f"{name} wrote no new file at this path: it has no sidecar")
            return
        fsync_dir(directory)
        # The sidecar comes last: until it is written, the new file fails verification (no or a stale digest).
        meta = self.record(checkpoint_step(checkpoint), intended)
        write_sidecar(target, digest=digest, meta=meta)
        if self.tag_last_good and os.path.basename(target) != LAST_GOOD_NAME:
            tag(target, os.path.join(directory, LAST_GOOD_NAME), digest, meta, self._writing)
        self.note_saved(target)

    def record(self, step: int | None, intended: Sequence[str] | None) -> dict[str, Any]:
        """nanguard's record of a checkpoint saved now (a sidecar's comment, a manifest's keys)."""
        meta: dict[str, Any] = {}
        if step is not None:
            meta["step"] = step
        if intended is not None:
            meta["intended_infinities"] = list(intended)
        if self.lineage is not None:
            meta["lineage"] = self.lineage.to_meta()
        return meta

    def note_saved(self, target: str) -> None:
        """A good checkpoint (a file, or a directory published by ``sharded``) is now at ``target``:
        carry out the removals deferred since a refusal in its directory, and report it."""
        directory = os.path.dirname(os.path.abspath(target))
        if os.path.basename(target) != LAST_GOOD_NAME:
            self._newest[directory] = target
        self._refused.discard(directory)
        self._release_deferred(directory, keep=target)
        self.notify(CheckpointEvent("saved", target))

    def note_refused(self, target: str) -> None:
        """A save to ``target`` was refused (by ``sharded``, on every rank): defer removals in its
        directory until a finite checkpoint is written there again, as for a refused file."""
        self._refused.add(os.path.dirname(os.path.abspath(target)))

    def newest_good(self, target: str) -> str:
        """The newest good checkpoint of ``target``'s directory as far as this wrapper knows, or ``""``."""
        return self._newest_good(os.path.dirname(os.path.abspath(target)))

    # ------------------------------------------------------------------ load
    @override
    def load_checkpoint(self, path: object, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        requested = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        extra: dict[str, Any] = {} if map_location is None else {"map_location": map_location}  # else the IO's default

        def load(p: str) -> Any:  # the file the caller named: the caller's weights_only (None means True)
            return self.checkpoint_io.load_checkpoint(p, weights_only=weights_only is not False, **extra)

        def load_safe(p: str) -> Any:  # a file nanguard chose: never unpickled beyond weights
            return self.checkpoint_io.load_checkpoint(p, weights_only=True, **extra)

        if _is_spawn_transfer(requested):
            return self.checkpoint_io.load_checkpoint(requested, weights_only=True, **extra)
        if not is_local_path(requested):
            return self._load_remote(requested, load)
        if not os.path.lexists(requested):
            # Lightning's own error type for a missing ckpt_path, so `except FileNotFoundError` keeps working. (A
            # dangling symlink, such as save_last="link" to a refused save, is a failed verification: fallback applies.)
            raise FileNotFoundError(f"Checkpoint file not found: {requested}")
        module = self.live_module() if self.live_module is not None else None
        result, checkpoint = verify_and_load(requested, require_sidecar=self.require_sidecar, load=load, module=module)
        if result.ok:
            self.resumed(requested, checkpoint_step(checkpoint))
            self.notify(CheckpointEvent("loaded", requested, result.note))  # the note: a stale sidecar passed over
            return checkpoint
        later: list[str] = []
        bound = fallback_bound(requested, result.step)
        if self.fallback:

            def verify(candidate: str) -> tuple[bool, int | None, Any]:
                found, loaded = verify_and_load(
                    candidate, require_sidecar=self.require_sidecar, load=load_safe, module=module
                )
                return found.ok, checkpoint_step(loaded), loaded

            # Files only: this IO loads a candidate with torch.load (a directory is loaded by the strategy).
            candidates = checkpoint_files(os.path.dirname(os.path.abspath(requested)))
            chosen, checkpoint, later = find_fallback(requested, candidates, verify, bound)
            if chosen is not None:
                step = checkpoint_step(checkpoint)
                self.resumed(chosen, step)
                self.notify(
                    CheckpointEvent(
                        "fallback", requested, result.reason, substitute=chosen, step=step, bound=bound.step
                    )
                )
                return checkpoint
        message = self.load_error(requested, result.reason, later, bound)
        self.notify(CheckpointEvent("refused_load", requested, result.reason))
        raise CheckpointVerificationError(message)

    def resumed(self, loaded: str, step: int | None) -> None:
        """A checkpoint was loaded: where this is the fit's resume, the lineage now descends from ``loaded``'s."""
        if self.track_lineage and self.lineage is not None:
            self.lineage = self.lineage.resumed_from(lineage_of(meta_of(loaded)), step or 0)
        self.track_lineage = False

    # ------------------------------------------------------------------ delegated
    @override
    def remove_checkpoint(self, path: Any) -> None:
        target = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        if _is_spawn_transfer(target) or not is_local_path(target):
            self.checkpoint_io.remove_checkpoint(path)
            return
        directory = os.path.dirname(os.path.abspath(target))
        if directory in self._refused and os.path.exists(target):
            # The caller (ModelCheckpoint's retention) believes the refused checkpoint exists and replaces this one:
            # keep it until a finite checkpoint is written in this directory again.
            self._deferred.setdefault(directory, []).append(target)
            self.notify(CheckpointEvent("kept", target, "a newer save in this directory was refused", kept=target))
            return
        self._remove(target)

    @override
    def teardown(self) -> None:
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ internals
    def _remove(self, target: str) -> None:
        self.checkpoint_io.remove_checkpoint(target)
        remove_sidecars(target)
        for directory, newest in list(self._newest.items()):
            if newest == target:
                del self._newest[directory]

    def _release_deferred(self, directory: str, keep: str) -> None:
        for path in self._deferred.pop(directory, []):
            if os.path.abspath(path) != os.path.abspath(keep):  # saved again since: it is current, not retired
                self._remove(path)

    def _newest_good(self, directory: str) -> str:
        """The newest good checkpoint of ``directory`` as far as this wrapper knows (it wrote it or the tag)."""
        newest = self._newest.get(directory, "")
        if newest and os.path.exists(newest):  # a file, or a distributed checkpoint directory
            return newest
        tag = os.path.join(directory, LAST_GOOD_NAME)
        return tag if self.tag_last_good and os.path.isfile(tag) else ""

    def notify(self, event: CheckpointEvent) -> None:
        """Tell the listener (the callback) about ``event``."""
        if self.listener is not None:
            self.listener(event)

    def _tell(self, kind: str, path: str, reason: str) -> None:
        if kind not in self._told:  # once per wrapper and kind: a warning per save would drown the log
            self._told.add(kind)
            self.notify(CheckpointEvent("unverified", path, reason))

    def load_error(self, path: str, reason: str, later: Sequence[str] = (), bound: FallbackBound | None = None) -> str:
        """The message of a refused load, with this wrapper's settings (``events.load_error``)."""
        return load_error(
            path,
            reason,
            later,
            require_sidecar=self.require_sidecar,
            fallback=self.fallback,
            bound=bound.describe() if bound is not None else "",
            step=bound.step if bound is not None else None,
        )

    def _load_remote(self, path: str, load: Callable[[str], Any]) -> Any:
        checkpoint = load(path)
        bad = nonfinite_tensors(checkpoint)
        if bad:
            reason = f"non-finite values in {', '.join(bad[:3])}"
            self.notify(CheckpointEvent("refused_load", path, reason))
            raise CheckpointVerificationError(self.load_error(path, reason))
        self._tell("remote", path, "not a local file: finiteness checked, checksum not (checksums are local-only)")
        return checkpoint


def _is_spawn_transfer(path: str) -> bool:
    """The file ``ddp_spawn``'s launcher writes in a fresh temporary directory to hand the final weights of rank 0 to
    the main process (``_MultiProcessingLauncher._collect_rank_zero_results``): not a checkpoint. It is passed
    through untouched: refusing it would crash the main process, and it gets no sidecar or tag (nothing would remove
    them)."""
    return os.path.basename(path) == ".temp.ckpt" and os.path.abspath(path).startswith(
        os.path.join(os.path.abspath(tempfile.gettempdir()), "")
    )
