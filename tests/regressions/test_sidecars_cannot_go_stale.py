"""A checkpoint's sidecar and tag never outlive the file they describe (issue 30).

A session with plain Lightning rewrote ``last.ckpt`` and left nanguard's sidecar of the older file beside it: the next
guarded resume called the good file corrupt and fell back, weights only, to an older checkpoint while the step
counter went on. A sidecar whose file was written again after it is stale (not corruption): the file is verified on
its own. A file damaged in place is still corrupt, and the tag, which nanguard writes with its sidecar, never goes
stale. A checkpoint the project deletes leaves neither its sidecar nor a tag holding its bytes (``checkpointing/orphans.py``).
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_nanguard import CheckpointGuard, cli, verify_checkpoint
from lightning_nanguard.checkpointing.orphans import remove_orphans
from lightning_nanguard.checkpointing.sidecar import SIDECAR_SUFFIX, read_sidecar, write_sidecar
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME
from lightning_nanguard.engine import get_engine
from tests.helpers import TinyModel, make_trainer

# The plain session resumes a guarded run's checkpoint without CheckpointGuard: Lightning says so.
pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")


def _fit(tmp_path: pathlib.Path, ck: pathlib.Path, steps: int, callbacks: list[pl.Callback], **kw: Any) -> pl.Trainer:
    mc = ModelCheckpoint(dirpath=str(ck), save_last=True, every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer(tmp_path, max_steps=steps, enable_checkpointing=True, callbacks=[mc, *callbacks])
    trainer.fit(TinyModel(), ckpt_path=kw.get("ckpt_path"))
    return trainer


@pytest.mark.parametrize("guard", [CheckpointGuard(fallback=True, require_sidecar=False), CheckpointGuard()])
def test_a_last_ckpt_plain_lightning_rewrote_is_resumed_from_not_fallen_back_from(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, guard: CheckpointGuard
) -> None:
    ck = tmp_path / "ck"
    _fit(tmp_path, ck, 8, [CheckpointGuard()])  # guarded: last.ckpt of step 8 and its sidecar
    _fit(tmp_path, ck, 16, [], ckpt_path="last")  # plain Lightning: last.ckpt of step 16, the sidecar still step 8's
    last = str(ck / "last.ckpt")
    sidecar = read_sidecar(last)
    assert sidecar is not None
    assert sidecar.stale
    with caplog.at_level(logging.INFO):
        resumed = _fit(tmp_path, ck, 20, [guard], ckpt_path=last)
    assert [r.action for r in get_engine(resumed).sink.records] == []  # no fallback, no refusal
    assert resumed.global_step == 20  # went on from step 16: 4 more steps
    assert any("last.ckpt.checksum is stale" in r.getMessage() for r in caplog.records)
    assert verify_checkpoint(last).ok  # the guarded session's save wrote a sidecar that matches again


def test_a_file_changed_in_place_is_still_corrupt_and_keeps_its_record(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    _fit(tmp_path, ck, 8, [CheckpointGuard()])
    last = ck / "last.ckpt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a tensor's bytes: the zip CRC-32 fails
    last.write_bytes(bytes(data))
    sidecar = read_sidecar(str(last))
    assert sidecar is not None
    assert not sidecar.stale
    assert sidecar.meta["step"] == 8
    result = verify_checkpoint(str(last))
    assert not result.ok
    assert "sha256 does not match" in result.reason


def test_the_tag_never_goes_stale_when_its_source_is_rewritten_in_place(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    _fit(tmp_path, ck, 8, [CheckpointGuard()])
    tag, last = ck / LAST_GOOD_NAME, ck / "last.ckpt"
    assert os.path.samefile(tag, last)
    ckpt = torch.load(last, weights_only=True)
    ckpt["global_step"] = 99
    with open(last, "r+b") as f:  # a script's torch.save over the file, in place: the tag shares the inode
        f.truncate(0)
        torch.save(ckpt, f)
    assert verify_checkpoint(str(last)).ok  # the source, written again, verifies on its own
    result = verify_checkpoint(str(tag))
    assert not result.ok  # the tag vouched for other bytes
    assert "sha256 does not match" in result.reason


class Listing(pl.Callback):
    """The checkpoint directory's names when training starts (after CheckpointGuard's own train start)."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory, self.names = directory, list[str]()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.names = sorted(p.name for p in self.directory.iterdir())


def test_a_checkpoint_the_project_deletes_leaves_no_sidecar_and_no_tag_of_its_bytes(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), filename="first")
    make_trainer(tmp_path, max_steps=4, enable_checkpointing=True, callbacks=[mc, CheckpointGuard()]).fit(TinyModel())
    first = ck / "first.ckpt"
    assert os.path.samefile(first, ck / LAST_GOOD_NAME)
    os.remove(first)  # the project's own cleanup: the tag alone holds its bytes now
    mc, listing = ModelCheckpoint(dirpath=str(ck), filename="second"), Listing(ck)
    trainer = make_trainer(tmp_path, max_steps=4, enable_checkpointing=True, callbacks=[mc, CheckpointGuard(), listing])
    trainer.fit(TinyModel())
    assert listing.names == []  # at train start: no sidecar of the deleted file, no tag of its bytes
    names = sorted(p.name for p in ck.iterdir())
    assert names == [LAST_GOOD_NAME, LAST_GOOD_NAME + SIDECAR_SUFFIX, "second.ckpt", "second.ckpt" + SIDECAR_SUFFIX]
    assert os.path.samefile(ck / "second.ckpt", ck / LAST_GOOD_NAME)


def test_orphans_are_found_without_a_trainer(tmp_path: pathlib.Path) -> None:
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    for path, n in ((a, 3), (b, 300)):
        torch.save({"w": torch.ones(n)}, path)
        write_sidecar(str(path))
    tag = tmp_path / LAST_GOOD_NAME
    os.link(a, tag)
    write_sidecar(str(tag))  # a tag of an older version: no record of its source
    assert remove_orphans(str(tmp_path)) == []  # every file still has its name, the tag shares a's bytes
    os.remove(a)
    removed = sorted(os.path.basename(p) for p in remove_orphans(str(tmp_path)))
    assert removed == ["a.ckpt" + SIDECAR_SUFFIX, LAST_GOOD_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.ckpt", "b.ckpt" + SIDECAR_SUFFIX]


def test_nanguard_verify_notes_a_stale_sidecar_and_write_sidecar_replaces_it(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a.ckpt"
    torch.save({"w": torch.ones(3)}, path)
    write_sidecar(str(path))
    torch.save({"w": torch.zeros(3)}, path)  # another save over it, without the guard
    assert cli.main(["verify", str(path)]) == 0
    assert "note: its sidecar a.ckpt.checksum is stale" in capsys.readouterr().out
    assert cli.main(["verify", "--write-sidecar", str(path)]) == 0
    assert "sidecar written" in capsys.readouterr().out
    sidecar = read_sidecar(str(path))
    assert sidecar is not None
    assert not sidecar.stale
