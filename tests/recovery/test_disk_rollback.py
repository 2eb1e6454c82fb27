"""The disk rollback restores checkpoint files only: a verified distributed checkpoint directory beside them (which
``torch.load`` cannot load) is never chosen, nor counted as something to restore."""

from __future__ import annotations

import os
import pathlib

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_nanguard import AutoRollback, CheckpointGuard, last_good_checkpoint
from lightning_nanguard._files import hash_file
from lightning_nanguard.checkpointing.manifest import MANIFEST_NAME, directory_files, write_manifest
from lightning_nanguard.policies.rollback import RollbackPolicy
from lightning_nanguard.recovery.rollback import restore_state
from lightning_nanguard.recovery.snapshot import SnapshotRing
from tests.helpers import TinyModel, make_trainer, params_of


def _verified_directory(path: pathlib.Path, step: int, newer_than: str) -> str:
    """A distributed checkpoint directory with a manifest that verifies, modified after ``newer_than``."""
    path.mkdir()
    for name in ("__0_0.distcp", ".metadata"):
        (path / name).write_bytes(name.encode())
    files = {}
    for name in directory_files(str(path)):
        size, digest = hash_file(str(path / name))
        files[name] = {"size": size, "sha256": digest}
    write_manifest(str(path), files, step=step, epoch=0, world_size=1)
    later = os.stat(newer_than).st_mtime_ns + 10**9
    os.utime(path / MANIFEST_NAME, ns=(later, later))
    return str(path)


def test_a_verified_directory_next_to_files_is_not_chosen_by_the_disk_rollback(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=8).fit(TinyModel())
    file8 = str(ck / "epoch=0-step=8.ckpt")
    directory = _verified_directory(ck / "epoch=0-step=6-distributed.ckpt", step=6, newer_than=file8)
    assert last_good_checkpoint(str(ck), at_or_before_step=8) == directory  # the newest verified candidate

    trainer = make_trainer(tmp_path / "second", max_steps=8)
    model = TinyModel()
    trainer.fit(model)
    restored = restore_state(trainer, model, SnapshotRing(0), RollbackPolicy().decide(8), str(ck), at_or_before_step=8)
    assert restored is not None
    assert (restored.source, restored.path, restored.step) == ("disk", file8, 8)
    saved = torch.load(file8, weights_only=True)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in params_of(model).items())


def test_a_verified_directory_alone_is_nothing_the_disk_rollback_can_restore(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    anchor = ck / "anchor"
    anchor.write_bytes(b"")
    _verified_directory(ck / "epoch=0-step=2.ckpt", step=2, newer_than=str(anchor))
    anchor.unlink()
    rollback = AutoRollback(source="disk", num_snapshots=0, checkpoint_dir=str(ck))
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer.fit(TinyModel())
    assert last_good_checkpoint(str(ck), at_or_before_step=4) is not None
    assert not rollback.can_restore(trainer, 4)
