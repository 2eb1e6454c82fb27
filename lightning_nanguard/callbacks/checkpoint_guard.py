"""CheckpointGuard: no checkpoint with NaN weights is written as good, and none is resumed from unverified."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_nanguard._validation import check_choice
from lightning_nanguard.callbacks._common import check_strategy_supported, make_incident
from lightning_nanguard.checkpoints import LAST_GOOD_NAME
from lightning_nanguard.engine import get_engine
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.policies.verdict import Action
from lightning_nanguard.recovery.verifying_io import CheckpointEvent, VerifyingCheckpointIO

__all__ = ["CheckpointGuard"]


class CheckpointGuard(Callback):
    """Write every checkpoint atomically with a sha256 sidecar, refuse non-finite ones, verify before resuming.

    In ``setup`` the strategy's ``CheckpointIO`` is wrapped (``trainer.strategy.checkpoint_io``), so every checkpoint
    Lightning writes (ModelCheckpoint, ``trainer.save_checkpoint``, other callbacks) and every checkpoint it reads
    (``fit(ckpt_path=...)``, ``validate``/``test``/``predict``) goes through it:

    * **save** (global rank 0, the only rank that writes): a checkpoint whose weights or optimizer state hold NaN/inf
      is not written at all (a ``refuse`` incident names the tensors); a good one is written to a temporary file in
      the same directory, fsynced, renamed onto the target, and then gets ``<file>.sha256``. The directory's
      ``nanguard-last-good.ckpt`` (a hard link with its own sidecar) then points at it: ModelCheckpoint's top-k
      retention never deletes it, so the last good weights survive a run that went NaN.
    * **load** (every rank, before any weight is used): checksum, ``torch.load(weights_only=True)``, finiteness.
      A failure raises ``CheckpointVerificationError`` naming the file, the reason and what to try; with
      ``fallback=True`` the newest verified checkpoint of the same directory is loaded instead and a ``fallback``
      incident names both files (``trainer.ckpt_path`` still shows the requested one).

    ``weights_only=True`` refuses pickled custom objects in hyperparameters (``pathlib.Path``, ``argparse.Namespace``,
    numpy scalars): allow-list them with ``torch.serialization.add_safe_globals([...])`` or pass
    ``fit(..., weights_only=False)`` for files you trust. The wrapper stays installed after fit, so a final
    ``trainer.save_checkpoint(...)`` still gets its sidecar. To resume by hand, use
    ``lightning_nanguard.last_good_checkpoint(dirpath)``.

    Args:
        require_sidecar: refuse to load a file without its ``.sha256`` sidecar (written by CheckpointGuard or by
            ``nanguard verify --write-sidecar``). ``False`` checks such files for readability and finiteness only.
        fallback: on a failed verification, resume from the newest verified checkpoint of the same directory.
        tag_last_good: keep ``nanguard-last-good.ckpt`` pointing at the newest good checkpoint of each directory.

    Logged keys:
        ``nanguard/incident/refuse``     1.0 when a checkpoint was refused (save: rank 0; load: every rank)
        ``nanguard/incident/fallback``   1.0 when a resume fell back to another file (at train start)

    Raises:
        NanGuardConfigError: at construction, for an argument outside its rule.
        UnsupportedSetupError: at setup, for sharded strategies or an asynchronous CheckpointIO.
        CheckpointVerificationError: when a checkpoint to load fails verification and there is no fallback.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> trainer = Trainer(callbacks=[ModelCheckpoint(save_top_k=3), CheckpointGuard(fallback=True)])
    """

    def __init__(self, require_sidecar: bool = True, fallback: bool = False, tag_last_good: bool = True) -> None:
        owner = type(self).__name__
        check_choice(owner, "require_sidecar", require_sidecar, (True, False))
        check_choice(owner, "fallback", fallback, (True, False))
        check_choice(owner, "tag_last_good", tag_last_good, (True, False))
        self.require_sidecar = require_sidecar
        self.fallback = fallback
        self.tag_last_good = tag_last_good
        self.refused_saves = 0
        self.last_saved: str | None = None
        self._trainer: pl.Trainer | None = None
        self._fit = False
        self._pending: list[CheckpointEvent] = []

    @property
    @override
    def state_key(self) -> str:
        # No arguments in the key: one guard per Trainer, and resuming with other settings (fallback=True) is normal.
        return self._generate_state_key()

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        owner = type(self).__name__
        check_strategy_supported(trainer, owner)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, VerifyingCheckpointIO):  # a second fit on the same Trainer: reuse, with our settings
            io.listener = self._on_event
            io.require_sidecar, io.fallback, io.tag_last_good = self.require_sidecar, self.fallback, self.tag_last_good
        else:
            if "AsyncCheckpointIO" in {cls.__name__ for cls in type(io).__mro__}:
                raise UnsupportedSetupError(
                    f"{owner} cannot checksum checkpoints written in the background by AsyncCheckpointIO: the file "
                    "is not complete when save_checkpoint returns. Remove AsyncCheckpointIO from Trainer(plugins=...) "
                    "or remove CheckpointGuard."
                )
            trainer.strategy.checkpoint_io = VerifyingCheckpointIO(
                io,
                require_sidecar=self.require_sidecar,
                fallback=self.fallback,
                tag_last_good=self.tag_last_good,
                listener=self._on_event,
            )
        self._trainer = trainer
        self._fit = stage == "fit"
        self._pending = []
        if self._fit:
            get_engine(trainer).join(trainer, self, fit=False)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)  # global_step is restored now, so a fallback incident names the step resumed at

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        get_engine(trainer).finish(trainer, raise_pending=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._fit:
            self._flush(trainer)
            get_engine(trainer).finish(trainer, raise_pending=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            get_engine(trainer).close()
        # The wrapper stays installed (a later trainer.save_checkpoint still gets its sidecar); events after this
        # point are warned about rather than recorded, as there is no fit to record them in.
        self._fit = False

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "refused_saves": self.refused_saves, "last_saved": self.last_saved or ""}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.refused_saves = int(state_dict.get("refused_saves", 0))
        self.last_saved = str(state_dict.get("last_saved", "")) or None

    # ------------------------------------------------------------------ events from the wrapper
    def _on_event(self, event: CheckpointEvent) -> None:
        if event.kind == "saved":
            self.last_saved = event.path
        elif event.kind == "refused_save":
            self.refused_saves += 1
            self._report(event)
        elif event.kind == "unverified":
            rank_zero_warn(f"CheckpointGuard: {event.path}: {event.reason}.")
        elif event.kind == "fallback":
            rank_zero_warn(self._message(event))
            self._pending.append(event)  # recorded at train start, when the resumed step is known
        elif event.kind == "refused_load":
            self._report(event)

    def _flush(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            self._report(event)

    def _report(self, event: CheckpointEvent) -> None:
        trainer = self._trainer
        message = self._message(event)
        if event.kind == "refused_save":
            rank_zero_warn(message)
        if trainer is None or not self._fit:
            return  # outside fit there is no incident log; the warning above or the raised error says it all
        values: dict[str, Any] = {"file": event.path, "reason": event.reason}
        if event.substitute:
            values["loaded"] = event.substitute
        if event.tensors:
            values["nonfinite_tensors"] = ", ".join(event.tensors[:10])
        incident = make_incident(
            trainer,
            trigger="nonfinite_checkpoint" if event.kind == "refused_save" else "checkpoint_verification_failed",
            action=Action.FALLBACK if event.kind == "fallback" else Action.REFUSE,
            source=type(self).__name__,
            values=values,
            message=message,
        )
        get_engine(trainer).sink.record(trainer, incident)

    def _message(self, event: CheckpointEvent) -> str:
        if event.kind == "refused_save":
            shown = ", ".join(event.tensors[:3]) + (
                f" and {len(event.tensors) - 3} more" if len(event.tensors) > 3 else ""
            )
            where = f" at global_step={self._trainer.global_step}" if self._trainer is not None else ""
            tag = os.path.join(os.path.dirname(os.path.abspath(event.path)), LAST_GOOD_NAME)
            if self.tag_last_good and os.path.isfile(tag):
                kept = f"the newest good checkpoint stays at {tag}"
            else:
                kept = "earlier checkpoints are untouched"
            return (
                f"CheckpointGuard refused to write {event.path}{where}: non-finite values in {shown}. Nothing was "
                f"written; {kept}. The weights or optimizer state went non-finite: add GradNormMonitor or "
                "AutoRollback to stop such updates, lower the learning rate, or resume from the last good checkpoint."
            )
        if event.kind == "fallback":
            return (
                f"CheckpointGuard: {event.path} failed verification ({event.reason}); loaded {event.substitute}, "
                "the newest verified checkpoint of that directory, instead. trainer.ckpt_path still shows the "
                "requested file."
            )
        return f"CheckpointGuard refused to load {event.path}: {event.reason}."
