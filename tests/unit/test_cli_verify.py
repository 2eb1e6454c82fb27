"""``nanguard verify``: exit 0 for good files, non-zero with the reason for bad ones."""

from __future__ import annotations

import pathlib

import pytest
import torch

from lightning_nanguard import cli
from lightning_nanguard.checkpoints import SIDECAR_SUFFIX, verify_checkpoint, write_sidecar


def _save(path: pathlib.Path, value: float = 1.0, sidecar: bool = True) -> str:
    torch.save({"state_dict": {"w": torch.full((3,), value)}}, path)
    if sidecar:
        write_sidecar(str(path))
    return str(path)


def test_verify_good_file_exits_zero(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _save(tmp_path / "good.ckpt")
    assert cli.main(["verify", good]) == 0
    assert capsys.readouterr().out.strip() == f"OK   {good}"


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("nan", "non-finite values in state_dict.w"), ("bitflip", "sha256 does not match"), ("missing", "does not exist")],
)
def test_verify_bad_file_exits_one_with_reason(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], kind: str, reason: str
) -> None:
    path = tmp_path / "bad.ckpt"
    if kind == "nan":
        _save(path, float("nan"))
    elif kind == "bitflip":
        _save(path)
        data = bytearray(path.read_bytes())
        data[-30] ^= 0xFF
        path.write_bytes(bytes(data))
    assert cli.main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {path}: ")
    assert reason in out


def test_verify_directory_and_sidecar_options(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "a.ckpt")
    plain = _save(tmp_path / "b.ckpt", sidecar=False)
    assert cli.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    assert "no checksum sidecar" in out
    assert "1 of 2 checkpoints verify" in out
    assert cli.main(["verify", "--no-require-sidecar", str(tmp_path)]) == 0
    capsys.readouterr()
    assert cli.main(["verify", "--write-sidecar", plain]) == 0
    assert "sidecar written" in capsys.readouterr().out
    assert pathlib.Path(plain + SIDECAR_SUFFIX).is_file()
    assert verify_checkpoint(plain).ok


def test_verify_write_sidecar_refuses_a_nonfinite_file(tmp_path: pathlib.Path) -> None:
    path = _save(tmp_path / "nan.ckpt", float("nan"), sidecar=False)
    assert cli.main(["verify", "--write-sidecar", path]) == 1
    assert not pathlib.Path(path + SIDECAR_SUFFIX).exists()
