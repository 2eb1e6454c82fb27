"""CheckpointGuard: no checkpoint with NaN weights is written as good, and none is resumed from unverified."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_nanguard import _notices
from lightning_nanguard.callbacks._base import NanGuardCallback, bind_hooks, unbind_hooks
from lightning_nanguard.callbacks._common import make_incident
from lightning_nanguard.checkpointing.events import CheckpointEvent, describe, incident_values
from lightning_nanguard.checkpointing.install import install_verifying_io, remove_killed_saves
from lightning_nanguard.checkpointing.lineage import Lineage
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO
from lightning_nanguard.config import CheckpointGuardConfig, arguments_from
from lightning_nanguard.contract import Action, Cause, Notice
from lightning_nanguard.engine import Engine, get_engine
from lightning_nanguard.signals.model_tensors import intended_infinities, record_intended_infinities

__all__ = ["CheckpointGuard"]


@arguments_from(CheckpointGuardConfig)
class CheckpointGuard(NanGuardCallback):
    """Write every checkpoint with a sha256 sidecar, refuse non-finite ones, verify before resuming.

    In ``setup`` the strategy's ``CheckpointIO`` is wrapped (``trainer.strategy.checkpoint_io``), so every checkpoint
    Lightning writes (ModelCheckpoint, ``trainer.save_checkpoint``, other callbacks) and every checkpoint it reads
    (``fit(ckpt_path=...)``, ``validate``/``test``/``predict``) goes through it:

    * **save** (global rank 0, the only rank that writes): a checkpoint whose weights or optimizer state hold NaN/inf
      (complex tensors included; the infinities of a buffer that held them at train start, a mask of -inf, aside)
      is not written at all (a ``refuse`` incident names the tensors), and removals in that directory
      (ModelCheckpoint's top-k retention, which believes the refused file exists) wait until a finite checkpoint is
      written there again. Lightning's ``TorchCheckpointIO`` writes a temporary file that is fsynced and renamed onto
      the target; a custom ``CheckpointIO`` is handed the caller's path and ``storage_options``. Then
      ``<file>.checksum`` (``sha256sum`` format, with nanguard's record: step, intended infinities, lineage) and the
      directory's ``nanguard-last-good.ckpt`` (a hard link with its own sidecar). Temporary files of killed saves are
      removed by a later run (only ours, and only when their writer is gone).
    * **load** (every rank, before any weight is used): checksum (without a sidecar, the zip CRC-32s torch stores),
      ``torch.load(weights_only=True)``, finiteness (a buffer's infinities are intended where the sidecar records them
      or the live module's buffer holds the same ones). A missing file raises ``FileNotFoundError``, as in plain
      Lightning. A failure raises ``CheckpointVerificationError`` naming the file, the reason and what to try; with
      ``fallback=True`` a verified checkpoint of the same directory is loaded instead (``checkpointing/fallback.py``):
      always with ``weights_only=True``, never of a later step than the requested file's (its recorded step) nor of
      another run's trajectory, and a ``fallback`` incident (cause ``corrupt_checkpoint``) names both files
      (``trainer.ckpt_path`` still shows the requested one).

    Under ``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy`` the strategy's own ``save_checkpoint`` and
    ``load_checkpoint`` are wrapped too (``checkpointing/sharded.py``): a directory checkpoint's finiteness is
    reduced across ranks before the save, its shards are hashed into ``nanguard-manifest.json`` and it is published
    with one rename; at resume rank 0 verifies it and every rank loads what it decided (the same error on every rank
    otherwise). No ``nanguard-last-good.ckpt`` tag is kept for directories; ``last_good_checkpoint`` lists them.

    ``weights_only=True`` refuses pickled custom objects in hyperparameters (``pathlib.Path``, ``argparse.Namespace``,
    numpy scalars): allow-list them with ``torch.serialization.add_safe_globals([...])``, or pass
    ``fit(..., weights_only=False)`` for the file you name and trust (a fallback file is still loaded weights-only).
    The wrapper stays installed after fit, so a final ``trainer.save_checkpoint(...)`` still gets its sidecar. To
    resume by hand, use ``lightning_nanguard.last_good_checkpoint(dirpath)``; to check files, ``nanguard verify``.
    Refusals of single files happen on rank 0 only and are reported, never fed to a training decision.

    Its arguments are declared once, in ``lightning_nanguard.config.CheckpointGuardConfig`` (the "Args" below).

    Logged keys:
        ``nanguard/incident/refuse``     1.0 when a checkpoint was refused (save: rank 0; load: every rank)
        ``nanguard/incident/fallback``   1.0 when a resume fell back to another file (at train start)

    Raises:
        NanGuardConfigError: at construction, for an argument that is not a bool.
        UnsupportedSetupError: at setup, for FSDPStrategy, DeepSpeedStrategy, XLAStrategy or an asynchronous
            CheckpointIO.
        FileNotFoundError: when the checkpoint to load does not exist.
        CheckpointVerificationError: when a checkpoint to load fails verification and there is no fallback.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> trainer = Trainer(callbacks=[ModelCheckpoint(save_top_k=3), CheckpointGuard(fallback=True)])
    """

    config: CheckpointGuardConfig
    steps_member = False  # checkpoints are not training steps: a guard alone must not make the engine watch them

    def __init__(self, require_sidecar: bool = True, fallback: bool = False, tag_last_good: bool = True) -> None:
        self.config = CheckpointGuardConfig.from_arguments(type(self).__name__, locals())
        self.refused_saves = 0
        self.last_saved: str | None = None
        self._trainer: pl.Trainer | None = None
        self._fit = False
        self._pending: list[CheckpointEvent] = []

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every stage, not only fit: validate/test/predict(ckpt_path=...) load through the wrapper too.
        unbind_hooks(self)
        self._check_environment(trainer)
        io = install_verifying_io(
            trainer,
            require_sidecar=self.config.require_sidecar,
            fallback=self.config.fallback,
            tag_last_good=self.config.tag_last_good,
            listener=self._on_event,
        )
        io.intended, io.live_module = self._intended, self._live_module  # bound methods: the Trainer still pickles
        self._trainer = trainer
        self._fit = stage == "fit"
        if self._fit:  # a new run: its own id; the resume (if any) extends the lineage of the file it loads
            io.lineage, io.track_lineage = Lineage.fresh(), True
        self._pending = []
        if self._fit:
            # A member, never the driver: checkpoints are not training steps, and a guard alone must not make the
            # engine watch them. ``join`` returns False for a non-driving member.
            engine = get_engine(trainer)
            self._drives = engine.join(trainer, self, fit=self.steps_member)
            self._engine_now = engine
            self._install(trainer, pl_module, engine)
            bind_hooks(self, engine, drives=False)  # no per-batch work: Lightning need not dispatch those hooks to it

    @override
    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: Engine) -> None:
        """No capability to register: the wrapper acts on its own, and only reports to the engine's sink."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if get_engine(trainer).driver is None:  # no driver recorded them: the saves and the end of fit need them
            record_intended_infinities(pl_module)
        if isinstance(io := trainer.strategy.checkpoint_io, VerifyingCheckpointIO):
            io.track_lineage = False  # the resume (if any) is done: a later load (validate, test) is not one
        self._flush(trainer)  # global_step is restored now, so a fallback incident names the step resumed at
        remove_killed_saves(trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Every rank builds the checkpoint (only rank 0 writes it), so this is a place to check the state together:
        # a non-finite buffer (a BatchNorm statistic) leaves the loss and gradients finite and no step check sees
        # it. The engine's corrupt-state path handles it now (a rollback restores the tensors in place, so the
        # checkpoint being built holds the restored values), instead of a refused save per checkpoint until the end.
        # (engine.restorer is rank-consistent: every rank registered the same callbacks.)
        # Only where something can restore it: without AutoRollback the save is refused (and the end of fit raises).
        engine = get_engine(trainer)
        if trainer.training and not trainer.sanity_checking and engine.restorer is not None:
            engine.check_state(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not self._fit:
            return
        self._flush(trainer)
        super().on_exception(trainer, pl_module, exception)
        if get_engine(trainer).driver is None:
            get_engine(trainer).finish(trainer, raise_pending=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
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

    # ------------------------------------------------------------------ what the wrapper asks
    def _intended(self) -> frozenset[str]:
        """The buffers whose infinities are intended (recorded at train start), for the save check and the record."""
        module = self._live_module()
        return intended_infinities(module) if module is not None else frozenset()

    def _live_module(self) -> pl.LightningModule | None:
        trainer = self._trainer
        return trainer.lightning_module if trainer is not None else None

    # ------------------------------------------------------------------ events from the wrapper
    def _on_event(self, event: CheckpointEvent) -> None:
        # File saves happen on global rank 0 only (a distributed save reports on every rank alike): what is done here
        # is reported, never fed to a decision (a rank-local
        # event must not steer any state that a collective depends on).
        if event.kind == "saved":
            self.last_saved = event.path
        elif event.kind == "refused_save":
            self.refused_saves += 1
            self._report(event)
        elif event.kind == "loaded" and event.reason:
            _notices.note(f"CheckpointGuard: {event.path} loaded; {event.reason}.")
        elif event.kind == "unverified":
            _notices.warn(f"CheckpointGuard: {event.path}: {event.reason}.")
        elif event.kind == "fallback":
            _notices.warn(describe(event))
            self._pending.append(event)  # recorded at train start, when the resumed step is known
        elif event.kind == "refused_load":
            self._report(event)

    def _flush(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            self._report(event)

    def _report(self, event: CheckpointEvent) -> None:
        trainer = self._trainer
        message = describe(event, trainer.global_step if trainer is not None else None)
        if event.kind == "refused_save":
            _notices.warn(message)
        if trainer is None or not self._fit:
            return  # outside fit there is no incident log; the warning above or the raised error says it all
        saving = event.kind == "refused_save"
        incident = make_incident(
            trainer,
            trigger=Notice.NONFINITE_CHECKPOINT if saving else Notice.CHECKPOINT_VERIFICATION_FAILED,
            action=Action.FALLBACK if event.kind == "fallback" else Action.REFUSE,
            source=type(self).__name__,
            values=incident_values(event),
            message=message,
            # A refused save: the state is non-finite; a failed verification: the file is corrupt (or non-finite).
            cause=(Cause.CORRUPT_STATE if saving else Cause.CORRUPT_CHECKPOINT).value,
            where=", ".join(event.tensors[:3]) if event.tensors else event.path,
        )
        get_engine(trainer).incidents.report(trainer, incident)
