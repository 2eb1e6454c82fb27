"""CheckpointGuard under ``ModelParallelStrategy`` and ``FSDPStrategy``: checksummed, atomically published
distributed checkpoints, and verified resumes decided on rank 0 and taken by every rank together.

``FSDPStrategy`` (FSDP1) saves and loads the same way: ``state_dict_type="sharded"`` writes the same directory
(``torch.distributed.checkpoint`` shards ``__{rank}_0.distcp``, ``.metadata``, ``meta.pt``; the state dict holds
``ShardedTensor``s, read here through their local shards), ``state_dict_type="full"`` (its default) one file
written by rank 0 through ``checkpoint_io``; its ``load_checkpoint`` reads either itself, on every rank.

``ModelParallelStrategy`` does not route its checkpoints through ``CheckpointIO`` the way other strategies do: every
rank calls ``strategy.save_checkpoint`` (with ``save_distributed_checkpoint=True`` each writes its shards of a
directory; with ``False`` the full state is gathered and rank 0 writes one file through ``checkpoint_io``), and every
rank calls ``strategy.load_checkpoint``, which reads the directory or file itself. So CheckpointGuard wraps those two
methods of the strategy instance (``install``), next to the ``VerifyingCheckpointIO`` it puts on the strategy's
``checkpoint_io`` (which still writes the single file of ``save_distributed_checkpoint=False``, on rank 0, with its
sidecar, exactly as under DDP).

Save of a directory (every rank, in the same order; each collective below is called by every rank):

1. the state's finiteness: each rank checks its local shards (``to_local()``, no communication) and the verdict is
   reduced (``any_rank``) **before** anything is written, so a non-finite state is refused on every rank together
   (the non-finite tensors of every rank are gathered for the message; the incident path only);
2. the strategy writes into ``.<name>.<pid>@<host>.tmp/`` (rank 0's name, broadcast) next to the target;
3. each rank hashes (sha256, after an fsync) the files it wrote (its ``__{rank}_*.distcp``; rank 0 also
   ``.metadata`` and ``meta.pt``), and the hashes are gathered to rank 0 (``all_gather_objects``);
4. rank 0 writes ``nanguard-manifest.json`` (``checkpointing/manifest.py``), fsyncs the directory and publishes it:
   ``os.replace(tmp, target)`` when the target does not exist, else an atomic exchange (Linux ``renameat2``
   ``RENAME_EXCHANGE``) and the old one removed; where no exchange exists, the old one is renamed aside to
   ``.<name>.replaced-<pid>@<host>`` first (a crash between the two renames leaves both complete directories, one of
   them under that name, never a half);
5. one more reduction of rank 0's outcome: every rank returns after the publish, or every rank raises.

Load (every rank): rank 0 verifies the requested directory (manifest, every file's size and sha256, no unlisted
shard) or file (sidecar, ``weights_only=True``, finiteness), falls back (``fallback=True``) to the newest verified
sibling at or before the requested step, and broadcasts its decision; every rank then loads the same path or raises
the same error. Nothing a rank decides alone reaches a collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard._files import fsync_dir, hash_file
from lightning_nanguard.checkpointing.events import CheckpointEvent
from lightning_nanguard.checkpointing.fallback import fallback_bound, find_fallback
from lightning_nanguard.checkpointing.manifest import directory_files, files_of_rank, write_manifest
from lightning_nanguard.checkpointing.sidecar import remove_sidecars
from lightning_nanguard.checkpointing.tmp_files import tmp_name
from lightning_nanguard.checkpointing.verify import checkpoint_candidates, nonfinite_tensors, verified_step
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO
from lightning_nanguard.exceptions import CheckpointVerificationError
from lightning_nanguard.signals.fsdp1 import is_fsdp1
from lightning_nanguard.signals.sharded import is_sharded, local_tensor

__all__ = ["LoadDecision", "decide_load", "install", "saves_directories"]


def saves_directories(strategy: object) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``, ``FSDPStrategy(state_dict_type=...)``: does it
    save directories?"""
    if is_fsdp1(strategy):  # "sharded": a directory of torch.distributed.checkpoint shards; "full" (default): a file
        return _lightning_compat.fsdp1_state_dict_type(strategy) == "sharded"
    return _lightning_compat.saves_distributed_checkpoint(strategy)


def install(trainer: pl.Trainer, io: VerifyingCheckpointIO) -> None:
    """Wrap ``trainer.strategy.save_checkpoint``/``load_checkpoint`` (once per strategy; a later fit re-points the
    wrappers at this Trainer and ``io``)."""
    strategy = trainer.strategy
    save = _lightning_compat.instance_attribute(strategy, "save_checkpoint")
    load = _lightning_compat.instance_attribute(strategy, "load_checkpoint")
    if isinstance(save, _GuardedSave) and isinstance(load, _GuardedLoad):
        save.rebind(trainer, io)
        load.rebind(trainer, io)
        return
    # Instance attributes over the class's methods (saved and re-assigned, never deleted): Lightning looks them up
    # on the instance, so every save and load of this strategy, whoever triggers it, goes through them.
    strategy.save_checkpoint = _GuardedSave(strategy.save_checkpoint, trainer, io)  # type: ignore[method-assign]
    strategy.load_checkpoint = _GuardedLoad(strategy.load_checkpoint, trainer, io)  # type: ignore[method-assign]


class _Bound:
    def __init__(self, original: Callable[..., Any], trainer: pl.Trainer, io: VerifyingCheckpointIO) -> None:
        self.original = original
        self._trainer: weakref.ref[pl.Trainer] = weakref.ref(trainer)  # the Trainer holds the strategy: no cycle
        self.io = io

    def rebind(self, trainer: pl.Trainer, io: VerifyingCheckpointIO) -> None:
        self._trainer = weakref.ref(trainer)
        self.io = io

    @property
    def trainer(self) -> pl.Trainer:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("nanguard: the Trainer of this strategy is gone; save or load through a new Trainer.")
        return trainer


# ---------------------------------------------------------------------------------------------------------- save
class _GuardedSave(_Bound):
    def __call__(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        trainer = self.trainer
        if not saves_directories(trainer.strategy):
            # One consolidated file, written by rank 0 through checkpoint_io (our VerifyingCheckpointIO): as DDP.
            self.original(checkpoint, filepath, storage_options=storage_options)
            return
        target = str(_distributed.broadcast_object(trainer, os.fspath(filepath)))  # rank 0's path, as the strategy
        if "://" in target and not target.startswith("file://"):
            self.original(checkpoint, filepath, storage_options=storage_options)
            reason = "not a local directory: written without a manifest (checksums are local-only)"
            self.io.notify(CheckpointEvent("unverified", target, reason))
            return
        target = os.path.abspath(target.removeprefix("file://"))
        if self._refuse_nonfinite(trainer, checkpoint, target):
            return
        tmp = str(_distributed.broadcast_object(trainer, tmp_name(target) if trainer.is_global_zero else None))
        if trainer.is_global_zero:
            _remove_tree(tmp)  # left by an earlier save of this process that failed
            os.makedirs(os.path.dirname(target), exist_ok=True)
        _distributed.barrier(trainer)  # every rank waits until the leftover is gone
        self.original(checkpoint, tmp, storage_options=storage_options)
        mine: dict[str, dict[str, Any]] = {}
        error = ""
        try:
            for name in files_of_rank(directory_files(tmp), trainer.global_rank):
                size, digest = hash_file(os.path.join(tmp, *name.split("/")), fsync=True)
                mine[name] = {"size": size, "sha256": digest}
        except OSError as err:
            error = f"rank {trainer.global_rank} could not hash its shard files ({type(err).__name__}: {err})"
        gathered = _distributed.all_gather_objects(trainer, (mine, error))
        failed = ""
        if trainer.is_global_zero:
            failed = self._publish(trainer, checkpoint, tmp, target, gathered)
        if _distributed.any_rank(trainer, bool(failed)):  # every rank waits for the publish, and agrees on it
            message = str(_distributed.broadcast_object(trainer, failed))
            raise CheckpointVerificationError(
                f"nanguard: the distributed checkpoint {target} was not published: {message}. Nothing was written "
                "in its place; the previous checkpoints of that directory are unchanged."
            )
        self.io.note_saved(target)

    def _refuse_nonfinite(self, trainer: pl.Trainer, checkpoint: dict[str, Any], target: str) -> bool:
        local = {
            "state_dict": _local(checkpoint.get("state_dict", {})),
            "optimizer_states": _local(checkpoint.get("optimizer_states", [])),
        }
        intended = sorted(self.io.intended()) if self.io.intended is not None else ()
        bad = nonfinite_tensors(local, intended)
        if not _distributed.any_rank(trainer, bool(bad)):
            return False
        named: list[str] = []
        for rank, names in enumerate(_distributed.all_gather_objects(trainer, bad)):  # the incident path only
            named.extend(f"{name} (rank {rank})" for name in names)
        self.io.note_refused(target)
        self.io.notify(
            CheckpointEvent(
                "refused_save",
                target,
                f"non-finite values in {len(named)} local shards",
                tensors=tuple(named),
                kept=self.io.newest_good(target),
            )
        )
        return True

    def _publish(
        self, trainer: pl.Trainer, checkpoint: dict[str, Any], tmp: str, target: str, gathered: list[Any]
    ) -> str:
        """Rank 0: write the manifest and publish ``tmp`` as ``target``; ``""`` or why it failed (tmp removed)."""
        files: dict[str, dict[str, Any]] = {}
        errors = [error for _, error in gathered if error]
        for mine, _ in gathered:
            files.update(mine)
        try:
            if errors:
                return "; ".join(errors)
            missing = sorted(set(directory_files(tmp)) - set(files))
            if missing or not files:
                return f"no rank hashed {', '.join(missing) or 'any file'} (the strategy wrote no shard files?)"
            step = checkpoint.get("global_step", trainer.global_step)
            epoch = checkpoint.get("epoch", trainer.current_epoch)
            step = int(step) if isinstance(step, int) else None
            intended = sorted(self.io.intended()) if self.io.intended is not None else None
            write_manifest(
                tmp,
                files,
                step=step,
                epoch=int(epoch) if isinstance(epoch, int) else None,
                world_size=trainer.world_size,
                record=self.io.record(step, intended),
            )
            fsync_dir(tmp)
            _publish_dir(tmp, target)
            remove_sidecars(target)  # a single-file save of this name had a sidecar
            fsync_dir(os.path.dirname(target))
        except OSError as err:
            return f"{type(err).__name__}: {err}"
        finally:
            _remove_tree(tmp)
        return ""


def _local(obj: Any) -> Any:
    """``obj`` with every ``DTensor`` replaced by this rank's local shard (a view; no communication), and every
    ``ShardedTensor`` (FSDP1's sharded state dict) by the list of this rank's local shards."""
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_local(v) for v in obj]
    shards = _lightning_compat.local_shards(obj)
    if shards is not None:
        return shards
    return local_tensor(obj) if is_sharded(obj) else obj


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return bool(renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0)


def _publish_dir(tmp: str, target: str) -> None:
    """Make ``tmp`` appear as ``target`` in one step; the old ``target`` (if any) ends up at ``tmp`` or is removed."""
    if not os.path.lexists(target):
        os.replace(tmp, target)  # a rename onto a missing name: atomic on POSIX
        return
    if _exchange(tmp, target):
        return  # the old checkpoint is now at tmp, removed by the caller
    aside = tmp_name(target + "-replaced")  # hidden, and without the target's name (see tmp_files)
    os.replace(target, aside)
    os.replace(tmp, target)
    _remove_tree(aside)


def _remove_tree(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


# ---------------------------------------------------------------------------------------------------------- load
@dataclass(frozen=True)
class LoadDecision:
    """Rank 0's verdict on a resume, broadcast to every rank: load ``path`` or raise (``missing``/``error``)."""

    path: str = ""
    step: int | None = None  # the chosen checkpoint's global_step, where known
    missing: bool = False
    error: str = ""
    events: tuple[CheckpointEvent, ...] = field(default=())


def decide_load(io: VerifyingCheckpointIO, requested: str) -> LoadDecision:
    """Verify ``requested`` (a distributed checkpoint directory or a file) and choose what to load, with ``io``'s
    ``require_sidecar`` and ``fallback``. Reads files only: no collective, no Lightning state."""
    if "://" in requested and not requested.startswith("file://"):
        why = "not a local path: loaded unverified (checksums are local-only)"
        return LoadDecision(requested, events=(CheckpointEvent("unverified", requested, why),))
    requested = requested.removeprefix("file://")
    if not os.path.lexists(requested):
        return LoadDecision(missing=True, error=f"Checkpoint file not found: {requested}")
    module = io.live_module() if io.live_module is not None else None
    reason, step = verified_step(requested, require_sidecar=io.require_sidecar, module=module)
    if reason is None:
        return LoadDecision(requested, step, events=(CheckpointEvent("loaded", requested),))
    later: list[str] = []
    bound = fallback_bound(requested)  # a directory's manifest still says which step it was
    if io.fallback:

        def verify(candidate: str) -> tuple[bool, int | None, int | None]:
            why, found = verified_step(candidate, require_sidecar=io.require_sidecar, module=module)
            return why is None, found, found

        candidates = checkpoint_candidates(os.path.dirname(os.path.abspath(requested)))
        chosen, step, later = find_fallback(requested, candidates, verify, bound)
        if chosen is not None:
            event = CheckpointEvent("fallback", requested, reason, substitute=chosen, step=step, bound=bound.step)
            return LoadDecision(chosen, step, events=(event,))
    message = io.load_error(requested, reason, later, bound)
    return LoadDecision(error=message, events=(CheckpointEvent("refused_load", requested, reason),))


class _GuardedLoad(_Bound):
    def __call__(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        trainer = self.trainer
        requested = os.fspath(checkpoint_path)
        decision: LoadDecision | None = None
        if trainer.is_global_zero:
            try:
                decision = decide_load(self.io, requested)
            except Exception as err:  # whatever happens on rank 0 must reach the other ranks, or they wait forever
                decision = LoadDecision(
                    error=f"nanguard: verifying {requested} failed on rank 0 ({type(err).__name__}: {err})"
                )
        decision = _distributed.broadcast_object(trainer, decision)
        assert isinstance(decision, LoadDecision)
        for event in decision.events:
            self.io.notify(event)
        if decision.missing:
            raise FileNotFoundError(decision.error)
        if decision.error:
            raise CheckpointVerificationError(decision.error)
        # The file the caller named: the caller's weights_only; a fallback nanguard chose: weights only.
        allowed = weights_only if decision.path == requested else True
        loaded = self.original(decision.path, weights_only=allowed)
        self.io.resumed(decision.path, decision.step)
        return loaded
