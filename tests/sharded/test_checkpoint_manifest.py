"""The manifest of a distributed checkpoint directory, its verification and its atomic publication (no processes)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from lightning_nanguard import cli
from lightning_nanguard._files import hash_file
from lightning_nanguard.checkpointing import sharded as sharded_checkpoint
from lightning_nanguard.checkpointing.manifest import (
    MANIFEST_NAME,
    directory_files,
    files_of_rank,
    verify_directory,
    write_manifest,
)
from lightning_nanguard.checkpointing.tmp_files import remove_stale_tmp_files, tmp_name
from lightning_nanguard.checkpointing.verify import last_good_checkpoint, verify_checkpoint, write_sidecar


def _distributed_checkpoint(path: pathlib.Path, step: int, payload: bytes = b"shard") -> str:
    """A directory laid out as torch.distributed.checkpoint + Lightning write it, with its manifest."""
    path.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
        (path / name).write_bytes(payload + name.encode())
    files = {}
    for name in directory_files(str(path)):
        size, digest = hash_file(str(path / name))
        files[name] = {"size": size, "sha256": digest}
    write_manifest(str(path), files, step=step, epoch=0, world_size=2)
    return str(path)


def test_each_file_is_hashed_by_exactly_one_rank() -> None:
    names = [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "meta.pt"]
    assert files_of_rank(names, 0) == [".metadata", "__0_0.distcp", "__0_1.distcp", "meta.pt"]
    assert files_of_rank(names, 1) == ["__1_0.distcp"]


def test_a_complete_directory_verifies(tmp_path: pathlib.Path) -> None:
    path = _distributed_checkpoint(tmp_path / "epoch=0-step=2.ckpt", step=2)
    assert verify_directory(path) is None
    assert verify_checkpoint(path).ok
    with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
        manifest = json.load(f)
    assert (manifest["step"], manifest["finite"], sorted(manifest["files"])) == (
        2,
        True,
        [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"],
    )


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("no_manifest", f"no {MANIFEST_NAME}"),
        ("bad_manifest", "cannot be read"),
        ("flip", "sha256 of __1_0.distcp does not match"),
        ("truncate", "__0_0.distcp is 3 bytes"),
        ("remove", "__1_0.distcp is listed in nanguard-manifest.json but missing"),
        ("unlisted", "files not in nanguard-manifest.json: __2_0.distcp"),
        ("not_finite", "does not record the state as finite"),
    ],
)
def test_a_damaged_directory_is_refused_with_the_reason(tmp_path: pathlib.Path, damage: str, reason: str) -> None:
    path = pathlib.Path(_distributed_checkpoint(tmp_path / "epoch=0-step=2.ckpt", step=2))
    manifest = path / MANIFEST_NAME
    if damage == "no_manifest":
        manifest.unlink()
    elif damage == "bad_manifest":
        manifest.write_text("{not json")
    elif damage == "flip":
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[0] ^= 1
        (path / "__1_0.distcp").write_bytes(bytes(data))
    elif damage == "truncate":
        (path / "__0_0.distcp").write_bytes(b"abc")
    elif damage == "remove":
        (path / "__1_0.distcp").unlink()
    elif damage == "unlisted":
        (path / "__2_0.distcp").write_bytes(b"from a 3-rank save")
    elif damage == "not_finite":
        content = json.loads(manifest.read_text())
        content["finite"] = False
        manifest.write_text(json.dumps(content))
    result = verify_checkpoint(str(path))
    assert not result.ok
    assert reason in result.reason
    assert cli.main(["verify", str(path)]) == 1


def test_last_good_checkpoint_lists_files_and_directories_by_step_and_time(tmp_path: pathlib.Path) -> None:
    older = _distributed_checkpoint(tmp_path / "epoch=0-step=2.ckpt", step=2)
    file4 = str(tmp_path / "epoch=0-step=4.ckpt")
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 4}, file4)
    write_sidecar(file4)
    os.utime(file4, ns=(os.stat(older).st_mtime_ns + 10**9,) * 2)
    newest = _distributed_checkpoint(tmp_path / "epoch=0-step=6.ckpt", step=6)
    os.utime(os.path.join(newest, MANIFEST_NAME), ns=(os.stat(file4).st_mtime_ns + 10**9,) * 2)
    assert last_good_checkpoint(str(tmp_path)) == newest
    assert last_good_checkpoint(str(tmp_path), at_or_before_step=5) == file4
    assert last_good_checkpoint(str(tmp_path), at_or_before_step=3) == older
    assert last_good_checkpoint(str(tmp_path), directories=False) == file4
    (pathlib.Path(newest) / "__0_0.distcp").write_bytes(b"corrupt")
    assert last_good_checkpoint(str(tmp_path)) == file4  # a directory that fails is skipped


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename_aside"])
def test_publishing_over_an_existing_directory_leaves_the_new_one_only(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    target = _distributed_checkpoint(tmp_path / "last.ckpt", step=2, payload=b"old")
    tmp = _distributed_checkpoint(pathlib.Path(tmp_name(target)), step=4, payload=b"new")
    if not exchange:
        monkeypatch.setattr(sharded_checkpoint, "_exchange", lambda a, b: False)
    sharded_checkpoint._publish_dir(tmp, target)
    sharded_checkpoint._remove_tree(tmp)  # what the saver does after a publish (the old one, after an exchange)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert (pathlib.Path(target) / "meta.pt").read_bytes() == b"newmeta.pt"
    assert verify_checkpoint(target).ok


def test_a_temporary_directory_of_a_dead_save_is_removed(tmp_path: pathlib.Path) -> None:
    target = str(tmp_path / "epoch=0-step=2.ckpt")
    mine = pathlib.Path(tmp_name(target))  # this process's name: not in use, so stale
    mine.mkdir()
    (mine / "__0_0.distcp").write_bytes(b"half")
    foreign = tmp_path / ".epoch=0-step=4.ckpt.12345@elsewhere.tmp"  # another host's, recent: left alone
    foreign.mkdir()
    kept = _distributed_checkpoint(tmp_path / "epoch=0-step=6.ckpt", step=6)
    assert remove_stale_tmp_files(str(tmp_path)) == [str(mine)]
    assert sorted(os.listdir(tmp_path)) == sorted([foreign.name, os.path.basename(kept)])
