"""checkpoints.py: sidecars, verification, the fused finiteness check, the newest verified file of a directory."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch

from lightning_nanguard import last_good_checkpoint
from lightning_nanguard.checkpoints import (
    LAST_GOOD_NAME,
    SIDECAR_SUFFIX,
    check_sidecar,
    nonfinite_tensors,
    sha256_of,
    verify_checkpoint,
    write_sidecar,
)


def _ckpt(value: float = 1.0, step: int = 0) -> dict[str, object]:
    w = torch.full((4, 3), value)
    return {
        "global_step": step,
        "state_dict": {"layer.weight": w, "layer.bias": torch.zeros(3), "count": torch.tensor(3)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(1.0)}}}],
    }


def _save(path: pathlib.Path, ckpt: dict[str, object], *, sidecar: bool = True) -> str:
    torch.save(ckpt, path)
    if sidecar:
        write_sidecar(str(path))
    return str(path)


def test_nonfinite_tensors_names_only_the_bad_ones_in_walk_order() -> None:
    ckpt = _ckpt()
    ckpt["state_dict"]["layer.bias"][1] = float("inf")  # type: ignore[index]
    ckpt["optimizer_states"][0]["state"][0]["exp_avg"][0, 0] = float("nan")  # type: ignore[index]
    assert nonfinite_tensors(ckpt) == ["state_dict.layer.bias", "optimizer_states[0].state.0.exp_avg"]


def test_nonfinite_tensors_accepts_huge_finite_values_in_every_dtype() -> None:
    # A 2-norm would overflow on these (Adam's exp_avg_sq can be this large); max-abs does not.
    ckpt = {
        "state_dict": {
            "big32": torch.full((1000,), 3e38),
            "big16": torch.full((1000,), 6e4, dtype=torch.float16),
            "bf16": torch.full((10,), 1e38, dtype=torch.bfloat16),
            "empty": torch.empty(0),
        }
    }
    assert nonfinite_tensors(ckpt) == []
    ckpt["state_dict"]["big16"][3] = float("-inf")
    assert nonfinite_tensors(ckpt) == ["state_dict.big16"]


def test_verify_good_and_each_failure(tmp_path: pathlib.Path) -> None:
    good = _save(tmp_path / "good.ckpt", _ckpt())
    assert verify_checkpoint(good).ok
    assert sha256_of(good) in (tmp_path / ("good.ckpt" + SIDECAR_SUFFIX)).read_text()

    missing = verify_checkpoint(str(tmp_path / "missing.ckpt"))
    assert (missing.ok, missing.reason) == (False, "file does not exist")

    nosidecar = _save(tmp_path / "nosidecar.ckpt", _ckpt(), sidecar=False)
    assert "no checksum sidecar nosidecar.ckpt.sha256" in verify_checkpoint(nosidecar).reason
    assert verify_checkpoint(nosidecar, require_sidecar=False).ok

    nan = _save(tmp_path / "nan.ckpt", _ckpt(float("nan")))
    assert verify_checkpoint(nan).reason == "non-finite values in state_dict.layer.weight"

    flipped = _save(tmp_path / "flipped.ckpt", _ckpt())
    data = bytearray(pathlib.Path(flipped).read_bytes())
    data[100] ^= 1
    pathlib.Path(flipped).write_bytes(bytes(data))
    assert "sha256 does not match" in verify_checkpoint(flipped).reason

    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    write_sidecar(str(garbage))
    reason = verify_checkpoint(str(garbage)).reason
    assert reason.startswith("cannot be loaded: the file is corrupt, truncated or not a torch checkpoint")
    assert "weights_only" not in reason  # never the advice to unpickle a corrupt file

    empty_sidecar = _save(tmp_path / "emptysc.ckpt", _ckpt())
    pathlib.Path(empty_sidecar + SIDECAR_SUFFIX).write_text("")
    assert "is empty" in verify_checkpoint(empty_sidecar).reason


def test_symlink_is_checked_against_its_targets_sidecar(tmp_path: pathlib.Path) -> None:
    target = _save(tmp_path / "epoch=0-step=2.ckpt", _ckpt())
    link = tmp_path / "last.ckpt"  # what ModelCheckpoint(save_last="link") makes
    os.symlink(os.path.basename(target), link)
    assert check_sidecar(str(link)) is None
    assert verify_checkpoint(str(link)).ok


def test_last_good_checkpoint_is_the_newest_that_verifies(tmp_path: pathlib.Path) -> None:
    assert last_good_checkpoint(str(tmp_path / "nowhere")) is None
    older = _save(tmp_path / "a.ckpt", _ckpt(step=1))
    newer = _save(tmp_path / "b.ckpt", _ckpt(float("nan"), step=2))
    os.utime(older, ns=(time.time_ns() - 10**9, time.time_ns() - 10**9))
    assert last_good_checkpoint(str(tmp_path)) == older  # newer is NaN
    os.link(older, tmp_path / LAST_GOOD_NAME)
    write_sidecar(str(tmp_path / LAST_GOOD_NAME))
    assert last_good_checkpoint(str(tmp_path)) == older  # same mtime as the tag: the original name wins
    os.remove(older)
    assert last_good_checkpoint(str(tmp_path)) == str(tmp_path / LAST_GOOD_NAME)
    os.symlink("b.ckpt", tmp_path / "z-link.ckpt")  # symlinks are skipped
    assert last_good_checkpoint(str(tmp_path)) == str(tmp_path / LAST_GOOD_NAME)
    assert newer != last_good_checkpoint(str(tmp_path), require_sidecar=False)


@pytest.mark.parametrize("digest", [None, "ab" * 32])
def test_write_sidecar_is_sha256sum_format(tmp_path: pathlib.Path, digest: str | None) -> None:
    path = _save(tmp_path / "x.ckpt", _ckpt(), sidecar=False)
    written = write_sidecar(path, digest=digest)
    assert written == (digest or sha256_of(path))
    assert (tmp_path / "x.ckpt.sha256").read_text() == f"{written}  x.ckpt\n"
    assert not list(tmp_path.glob("*.tmp"))
