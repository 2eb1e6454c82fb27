"""``nanguard verify``: exit 0 for good files, non-zero with the reason for bad ones."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from lightning_nanguard import cli
from lightning_nanguard.checkpointing.verify import SIDECAR_SUFFIX, verify_checkpoint, write_sidecar
from tests.helpers import TinyModel, make_trainer


def _data_offset(path: str, member: Any) -> int:
    """Where a zip member's bytes start: after its local header, whose extra field (torch's alignment padding) can
    differ from the central directory's."""
    import struct

    with open(path, "rb") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return int(member.header_offset + 30 + name_len + extra_len)


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


@pytest.mark.parametrize("layout", ["plain", "nested"])
def test_verify_never_blesses_a_nan_plain_state_dict(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        m.weight[0, 0] = float("nan")
    path = str(tmp_path / "model.ckpt")
    torch.save(m.state_dict() if layout == "plain" else {"model": m.state_dict()}, path)
    name = "weight" if layout == "plain" else "model.weight"
    for args in (["--no-require-sidecar"], ["--write-sidecar"], []):
        assert cli.main(["verify", *args, path]) == 1
        assert f"FAIL {path}: " in capsys.readouterr().out
    assert not pathlib.Path(path + SIDECAR_SUFFIX).exists()  # --write-sidecar did not adopt it
    assert cli.main(["verify", "--no-require-sidecar", path]) == 1
    assert f"non-finite values in {name}" in capsys.readouterr().out


def test_verify_without_sidecar_checks_the_zip_crc(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    import zipfile

    path = _save(tmp_path / "x.ckpt", sidecar=False)
    with zipfile.ZipFile(path) as archive:
        member = next(i for i in archive.infolist() if "/data/" in i.filename)
        offset = _data_offset(path, member)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[offset] ^= 0x01  # inside the tensor's bytes
    pathlib.Path(path).write_bytes(bytes(data))
    assert cli.main(["verify", "--write-sidecar", path]) == 1
    out = capsys.readouterr().out
    assert "CRC-32 mismatch" in out
    assert "weights_only=False" not in out
    assert not pathlib.Path(path + SIDECAR_SUFFIX).exists()


def test_version_and_exit_codes_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_nanguard import __version__

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanguard {__version__}"
    for argv in (["--help"], ["verify", "--help"], ["report", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = capsys.readouterr().out
        assert "exit codes:" in text
        assert "  1  nanguard verify: at least one checkpoint failed verification" in text


@pytest.mark.parametrize("weights", ["nan", "finite"])
def test_a_lightning_checkpoint_without_a_sidecar_has_its_contents_checked_too(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], weights: str
) -> None:
    """An ordinary Lightning checkpoint (no CheckpointGuard, so no sidecar) whose weights are all NaN: verify says
    both facts, not only "no checksum sidecar" (the NaN weights used to show only with --no-require-sidecar)."""
    model = TinyModel()
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(model)
    if weights == "nan":
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    path = str(tmp_path / "plain.ckpt")
    trainer.save_checkpoint(path)
    assert cli.main(["verify", path]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"FAIL {path}: no checksum sidecar plain.ckpt{SIDECAR_SUFFIX}")
    if weights == "nan":
        assert "; its contents: non-finite values in state_dict." in out
    else:
        assert out.endswith("; its contents: they verify (zip CRC-32s, a weights-only load, finite)")
    assert cli.main(["verify", "--no-require-sidecar", path]) == (1 if weights == "nan" else 0)
