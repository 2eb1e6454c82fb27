"""CheckpointGuard under ModelParallelStrategy + FSDP2 (2 gloo CPU ranks): distributed (directory) checkpoints with a
manifest, verified at resume on rank 0 with every rank taking the same decision; consolidated single files as DDP."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from lightning_nanguard import cli
from lightning_nanguard.checkpointing.manifest import MANIFEST_NAME
from lightning_nanguard.checkpointing.verify import SIDECAR_SUFFIX, last_good_checkpoint, verify_checkpoint
from tests.sharded._launch import run_checkpoint_ranks

pytestmark = pytest.mark.distributed

STEP2, STEP4 = "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 steps with a distributed checkpoint every 2 (steps 2 and 4), and the full parameters at each save."""
    root = tmp_path_factory.mktemp("saved")
    ranks = run_checkpoint_ranks({"ckpt_dir": str(root / "ckpt"), "max_steps": 4}, str(root / "run"))
    return {"root": root, "ckpt": str(root / "ckpt"), "run": str(root / "run"), "ranks": ranks}


def _copy_checkpoints(saved: dict[str, Any], tmp_path: Any) -> str:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved["ckpt"], ckpt)
    return ckpt


def _flip_a_byte(path: str) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x40  # inside the tensor bytes: torch.distributed.checkpoint itself would not notice
    with open(path, "wb") as f:
        f.write(data)


def _params(path: str) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, weights_only=True))


def _assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"


def test_distributed_checkpoint_is_saved_with_a_manifest_verified_and_resumed(
    saved: dict[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = saved["ckpt"]
    assert sorted(os.listdir(ckpt)) == [STEP2, STEP4]  # published directories only: no temporary one left behind
    for name in (STEP2, STEP4):
        path = os.path.join(ckpt, name)
        files = sorted(os.listdir(path))
        assert files == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", MANIFEST_NAME])
        assert verify_checkpoint(path).ok
    assert last_good_checkpoint(ckpt) == os.path.join(ckpt, STEP4)
    assert last_good_checkpoint(ckpt, at_or_before_step=3) == os.path.join(ckpt, STEP2)
    assert cli.main(["verify", os.path.join(ckpt, STEP4)]) == 0
    assert cli.main(["verify", ckpt]) == 0  # a directory of distributed checkpoints: each one verified
    out = capsys.readouterr().out
    assert f"OK   {os.path.join(ckpt, STEP2)}" in out
    assert "2 of 2 checkpoints verify" in out
    for rank in saved["ranks"]:
        assert rank["error"] == {}
        assert rank["incidents"] == []
        assert rank["last_saved"] == os.path.join(ckpt, STEP4)

    resumed = run_checkpoint_ranks(
        {"ckpt_dir": _copy_checkpoints(saved, tmp_path), "max_steps": 6, "ckpt_path": os.path.join(ckpt, STEP4)},
        str(tmp_path / "resume"),
    )
    for rank in resumed:
        assert (rank["error"], rank["start_step"], rank["global_step"], rank["incidents"]) == ({}, 4, 6, [])
    _assert_same_params(
        _params(str(tmp_path / "resume" / "params_start.pt")), _params(os.path.join(saved["run"], "params_step4.pt"))
    )


def test_a_shard_corrupted_on_one_rank_is_refused_on_both_ranks(saved: dict[str, Any], tmp_path: Any) -> None:
    ckpt = _copy_checkpoints(saved, tmp_path)
    _flip_a_byte(os.path.join(ckpt, STEP4, "__1_0.distcp"))  # rank 1's shard file only
    result = verify_checkpoint(os.path.join(ckpt, STEP4))
    assert not result.ok
    assert "sha256 of __1_0.distcp does not match" in result.reason
    assert cli.main(["verify", os.path.join(ckpt, STEP4)]) == 1

    ranks = run_checkpoint_ranks(
        {"ckpt_dir": ckpt, "max_steps": 6, "ckpt_path": os.path.join(ckpt, STEP4)}, str(tmp_path / "run")
    )
    errors = [rank["error"] for rank in ranks]
    assert errors[0] == errors[1]  # the same decision, and the same message, on both ranks (and neither hung)
    assert errors[0]["type"] == "CheckpointVerificationError"
    assert "__1_0.distcp" in errors[0]["message"]
    assert os.path.join(ckpt, STEP2) in errors[0]["message"]
    for r, rank in enumerate(ranks):
        assert rank["start_step"] == -1  # training never started: no weights were used
        assert [(i["action"], i["ranks"]) for i in rank["incidents"]] == [("refuse", [r])]


def test_a_corrupted_shard_falls_back_to_the_newest_verified_directory_on_both_ranks(
    saved: dict[str, Any], tmp_path: Any
) -> None:
    ckpt = _copy_checkpoints(saved, tmp_path)
    _flip_a_byte(os.path.join(ckpt, STEP4, "__1_0.distcp"))
    ranks = run_checkpoint_ranks(
        {"ckpt_dir": ckpt, "max_steps": 5, "fallback": True, "ckpt_path": os.path.join(ckpt, STEP4)},
        str(tmp_path / "run"),
    )
    for rank in ranks:
        assert (rank["error"], rank["start_step"], rank["global_step"]) == ({}, 2, 5)
        [incident] = rank["incidents"]
        assert incident["action"] == "fallback"
        assert incident["values"]["loaded"] == os.path.join(ckpt, STEP2)
    # Both ranks loaded their shards of the step-2 directory: the parameters are those saved at step 2.
    _assert_same_params(
        _params(str(tmp_path / "run" / "params_start.pt")), _params(os.path.join(saved["run"], "params_step2.pt"))
    )


def test_a_nonfinite_shard_on_rank1_refuses_the_save_on_both_ranks(tmp_path: Any) -> None:
    # After step 4's update, rank 1's local shard of body.0.weight holds a NaN; rank 0's shards are finite.
    ckpt = str(tmp_path / "ckpt")
    ranks = run_checkpoint_ranks({"ckpt_dir": ckpt, "max_steps": 4, "poison": [4, 1]}, str(tmp_path / "run"))
    for r, rank in enumerate(ranks):
        assert rank["refused_saves"] == 1
        [incident] = rank["incidents"]
        assert (incident["step"], incident["action"], incident["ranks"]) == (4, "refuse", [r])
        assert incident["values"]["nonfinite_tensors"] == "state_dict.body.0.weight (rank 1)"
        assert rank["last_saved"] == os.path.join(ckpt, STEP2)
    assert sorted(os.listdir(ckpt)) == [STEP2]  # nothing written for step 4, by either rank; no temporary left
    assert verify_checkpoint(os.path.join(ckpt, STEP2)).ok


def test_consolidated_single_file_checkpoints_are_verified_and_fallen_back_from(tmp_path: Any) -> None:
    # save_distributed_checkpoint=False: rank 0 writes one file through checkpoint_io, with its sidecar, as under DDP;
    # the strategy loads it itself, so the resume is verified by rank 0 and the decision broadcast.
    ckpt = str(tmp_path / "ckpt")
    run_checkpoint_ranks({"ckpt_dir": ckpt, "max_steps": 4, "distributed": False}, str(tmp_path / "save"))
    for name in (STEP2, STEP4):
        assert os.path.isfile(os.path.join(ckpt, name))
        assert os.path.isfile(os.path.join(ckpt, name + SIDECAR_SUFFIX))
        assert verify_checkpoint(os.path.join(ckpt, name)).ok
    _flip_a_byte(os.path.join(ckpt, STEP4))
    ranks = run_checkpoint_ranks(
        {
            "ckpt_dir": ckpt,
            "max_steps": 5,
            "distributed": False,
            "fallback": True,
            "ckpt_path": os.path.join(ckpt, STEP4),
        },
        str(tmp_path / "resume"),
    )
    for rank in ranks:
        assert (rank["error"], rank["start_step"]) == ({}, 2)
        assert [(i["action"], i["values"]["loaded"]) for i in rank["incidents"]] == [
            ("fallback", os.path.join(ckpt, STEP2))
        ]
    _assert_same_params(
        _params(str(tmp_path / "resume" / "params_start.pt")), _params(str(tmp_path / "save" / "params_step2.pt"))
    )
