"""A fallback never resumes from a later step than the file asked for, and never from another run's trajectory; a
disk rollback restores only the run's own past. Both are recorded as incidents."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_nanguard import AutoRollback, CheckpointGuard, CheckpointVerificationError, default_callbacks
from lightning_nanguard.checkpointing.fallback import FallbackBound, find_fallback
from lightning_nanguard.checkpointing.lineage import Lineage
from lightning_nanguard.checkpointing.sidecar import read_sidecar
from lightning_nanguard.engine import get_engine
from lightning_nanguard.engine.sink import INCIDENTS_FILE, SUMMARY_FILE
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


class Probe(Callback):
    def __init__(self) -> None:
        self.start_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step


def _run(root: pathlib.Path, ck: pathlib.Path, max_steps: int, **fit: Any) -> None:
    """A guarded run saving every 2 steps (all kept) and ``last.ckpt`` into ``ck``."""
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = make_trainer(root, callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=max_steps)
    trainer.fit(TinyModel(), **fit)


def _flip(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_fallback_takes_the_requested_step_from_the_record_never_a_later_or_foreign_file(
    tmp_path: pathlib.Path,
) -> None:
    # The new-user trial: a corrupt last.ckpt (step 8) beside a verified last-v1.ckpt of a later run (step 12).
    ck = tmp_path / "ck"
    _run(tmp_path / "a", ck, max_steps=8)
    _run(tmp_path / "b", ck, max_steps=12)  # a fresh run into the same directory: -v1 names, newer files
    assert (ck / "last-v1.ckpt").is_file()
    assert (ck / "epoch=0-step=8-v1.ckpt").is_file()
    _flip(ck / "last.ckpt")  # its sidecar still records step 8 and the first run's lineage
    probe = Probe()
    trainer = make_trainer(
        tmp_path / "resume", callbacks=[*default_callbacks(), probe], max_steps=10, logger=CSVLogger(str(tmp_path))
    )
    with pytest.warns(UserWarning, match=r"loaded .*/epoch=0-step=8\.ckpt of step 8 instead.* at or before step 8"):
        trainer.fit(TinyModel(), ckpt_path=str(ck / "last.ckpt"))
    # Not last-v1 (step 12, later), nor epoch=0-step=8-v1 (step 8, newer, but the second run's trajectory).
    assert probe.start_step == 8
    (incident,) = get_engine(trainer).sink.records
    assert (incident.cause, incident.actions, incident.step) == ("corrupt_checkpoint", ["fallback"], 8)
    assert incident.values["loaded"] == str(ck / "epoch=0-step=8.ckpt")
    assert (incident.values["loaded_step"], incident.values["requested_step"]) == (8, 8)
    log_dir = trainer.log_dir
    assert log_dir is not None
    with open(os.path.join(log_dir, INCIDENTS_FILE)) as f:
        assert json.loads(f.readline())["actions"] == ["fallback"]
    with open(os.path.join(log_dir, SUMMARY_FILE)) as f:
        summary = f.read()
    assert "corrupt_checkpoint" in summary
    assert "fallback" in summary


def test_without_an_earlier_verified_file_the_fallback_refuses_and_names_the_later_ones(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    for root, steps in (("a", 4), ("b", 8)):
        mc = ModelCheckpoint(dirpath=str(ck), save_last=True, save_top_k=0, every_n_train_steps=4)
        callbacks = [mc, CheckpointGuard(tag_last_good=False)]
        make_trainer(tmp_path / root, callbacks=callbacks, enable_checkpointing=True, max_steps=steps).fit(TinyModel())
    assert sorted(p.name for p in ck.glob("*.ckpt")) == ["last-v1.ckpt", "last.ckpt"]
    _flip(ck / "last.ckpt")
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(fallback=True)], max_steps=10)
    with pytest.raises(CheckpointVerificationError, match=r"at or before step 4 verifies; the newer verified ones"):
        trainer.fit(TinyModel(), ckpt_path=str(ck / "last.ckpt"))


def test_a_file_whose_step_is_unknown_bounds_the_fallback_by_its_time(tmp_path: pathlib.Path) -> None:
    old, requested, newer = (tmp_path / f"{n}.ckpt" for n in ("old", "requested", "newer"))
    for i, path in enumerate((old, requested, newer)):
        torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 10 * i}, path)
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    requested.write_bytes(b"no longer a checkpoint")  # no record, no step in the name, does not load
    os.utime(requested, ns=(10**18 + 10**9, 10**18 + 10**9))

    def verify(path: str) -> tuple[bool, int | None, Any]:
        ckpt = torch.load(path, weights_only=True)
        return True, ckpt["global_step"], ckpt

    bound = FallbackBound(step=None, written_ns=os.stat(requested).st_mtime_ns, lineage=None)
    chosen, loaded, later = find_fallback(str(requested), [str(newer), str(old)], verify, bound)
    assert (chosen, later) == (str(old), [str(newer)])  # newer has the higher step, but was written after it
    assert loaded["global_step"] == 0


def test_a_disk_rollback_restores_only_the_runs_own_past(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    _run(tmp_path / "a", ck, max_steps=12)  # steps 2..12: the first run, abandoned at step 4 below
    sidecar = read_sidecar(str(ck / "epoch=0-step=8.ckpt"))
    assert sidecar is not None
    assert len(sidecar.meta["lineage"]) == 1
    # Resumed from step 4 (no saves of its own), its state is corrupted at step 9: a rollback from disk is due.
    rb = AutoRollback(source="disk", num_snapshots=0, checkpoint_dir=str(ck))
    callbacks = [CheckpointGuard(), FaultInjector("param", steps=[9]), rb]
    trainer = make_trainer(tmp_path / "b", callbacks=callbacks, max_steps=11)
    trainer.fit(TinyModel(), ckpt_path=str(ck / "epoch=0-step=4.ckpt"))
    (incident,) = [r for r in get_engine(trainer).sink.records if r.action == "rollback"]
    # Steps 6 and 8 are verified and at or before step 9, but the first run wrote them after this run's start.
    assert incident.values["checkpoint"] == str(ck / "epoch=0-step=4.ckpt")
    assert incident.values["restored_from_step"] == 4


def test_lineage_admits_the_past_of_each_run_up_to_where_the_next_one_left_it() -> None:
    first = Lineage((("a", 0),))
    second = first.resumed_from(first, 4)  # a fresh id's place: resumed_from keeps this lineage's own run id
    assert second.runs == (("a", 0), ("a", 4))
    b = Lineage((("b", 0),)).resumed_from(first, 4)
    assert b.runs == (("a", 0), ("b", 4))
    assert b.admits(first, 4, now=9)
    assert not b.admits(first, 6, now=9)  # a's future past step 4: abandoned
    assert b.admits(b, 8, now=9)
    assert not b.admits(b, 10, now=9)  # its own files, never the future
    assert not b.admits(Lineage((("c", 0),)), 2, now=9)
    assert not b.admits(None, 2, now=9)  # another run, no record
    unknown_root = Lineage((("d", 0),)).resumed_from(None, 6)  # resumed from a file without a record
    assert unknown_root.admits(None, 6, now=9)
    assert not unknown_root.admits(None, 7, now=9)
