"""checkpointing/verify.py: sidecars, verification (any layout, complex tensors, zip CRC-32s), the fused finiteness check, the
newest verified file of a directory, and the verified, step-bounded load of a disk rollback."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import pytest
import torch

from lightning_nanguard import last_good_checkpoint
from lightning_nanguard._files import hash_file
from lightning_nanguard.checkpointing.verify import (
    LAST_GOOD_NAME,
    SIDECAR_SUFFIX,
    check_sidecar,
    check_zip_crc,
    checkpoint_step,
    nonfinite_tensors,
    verify_checkpoint,
    write_sidecar,
)
from lightning_nanguard.exceptions import CheckpointVerificationError
from lightning_nanguard.recovery.disk_restore import load_rollback_checkpoint, restore_from_checkpoint


def _data_offset(path: str, member: Any) -> int:
    """Where a zip member's bytes start: after its local header, whose extra field (torch's alignment padding) can
    differ from the central directory's."""
    import struct

    with open(path, "rb") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return int(member.header_offset + 30 + name_len + extra_len)


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
    assert hash_file(str(good))[1] in (tmp_path / ("good.ckpt" + SIDECAR_SUFFIX)).read_text()

    missing = verify_checkpoint(str(tmp_path / "missing.ckpt"))
    assert (missing.ok, missing.reason) == (False, "file does not exist")

    nosidecar = _save(tmp_path / "nosidecar.ckpt", _ckpt(), sidecar=False)
    assert "no checksum sidecar nosidecar.ckpt.checksum" in verify_checkpoint(nosidecar).reason
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
    assert written == (digest or hash_file(path)[1])
    assert (tmp_path / "x.ckpt.checksum").read_text() == f"{written}  x.ckpt\n"
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("layout", "name"),
    [
        ("plain", "weight"),  # torch.save(model.state_dict())
        ("nested", "model.weight"),  # {"model": state_dict}
        ("list", "[0]"),
        ("tensor", "tensor"),
    ],
)
def test_nan_in_any_layout_is_found_and_never_verifies(tmp_path: pathlib.Path, layout: str, name: str) -> None:
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        m.weight[0, 0] = float("nan")
    obj = {
        "plain": m.state_dict(),
        "nested": {"model": m.state_dict(), "epoch": 3},
        "list": [m.weight.detach()],
        "tensor": m.weight.detach(),
    }[layout]
    assert nonfinite_tensors(obj) == [name]
    path = _save(tmp_path / "model.ckpt", obj)  # type: ignore[arg-type]
    assert verify_checkpoint(path).reason == f"non-finite values in {name}"
    assert not verify_checkpoint(path, require_sidecar=False).ok
    assert last_good_checkpoint(str(tmp_path)) is None


def test_lightning_layout_ignores_callback_states_that_hold_infinities() -> None:
    ckpt = _ckpt()
    ckpt["callbacks"] = {"EarlyStopping{'monitor': 'val_loss'}": {"best_score": torch.tensor(float("inf"))}}
    assert nonfinite_tensors(ckpt) == []


def test_complex_tensors_are_checked_through_their_real_view() -> None:
    w = torch.randn(3, 2, dtype=torch.cfloat)
    ckpt = {"state_dict": {"w": w}, "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros_like(w)}}}]}
    assert nonfinite_tensors(ckpt) == []
    ckpt["optimizer_states"][0]["state"][0]["exp_avg"][1, 1] = complex(0.0, float("inf"))  # type: ignore[index]
    w[0, 0] = complex(float("nan"), 1.0)  # type: ignore[assignment]
    assert nonfinite_tensors(ckpt) == ["state_dict.w", "optimizer_states[0].state.0.exp_avg"]


def _flip_tensor_byte(path: str) -> None:
    """Flip one bit inside the bytes of the largest tensor (not in the zip structure): torch.load does not notice."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        offset = _data_offset(path, member)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[offset + member.file_size // 2] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))


def test_bit_flip_without_a_sidecar_fails_the_zip_crc(tmp_path: pathlib.Path) -> None:
    path = _save(tmp_path / "x.ckpt", {"state_dict": {"w": torch.arange(1000.0)}}, sidecar=False)
    assert check_zip_crc(path) is None
    _flip_tensor_byte(path)
    assert bool(torch.isfinite(torch.load(path, weights_only=True)["state_dict"]["w"]).all())  # loads "fine"
    reason = verify_checkpoint(path, require_sidecar=False).reason
    assert reason.startswith("the file is corrupt: CRC-32 mismatch in zip member")
    assert "weights_only" not in reason
    truncated = _save(tmp_path / "t.ckpt", {"state_dict": {"w": torch.ones(100)}}, sidecar=False)
    pathlib.Path(truncated).write_bytes(pathlib.Path(truncated).read_bytes()[:200])
    assert "corrupt or truncated" in verify_checkpoint(truncated, require_sidecar=False).reason
    legacy = tmp_path / "legacy.ckpt"  # the pre-zip format has no checksum: its contents are still checked
    torch.save({"state_dict": {"w": torch.ones(3)}}, legacy, _use_new_zipfile_serialization=False)
    assert check_zip_crc(str(legacy)) is None
    assert verify_checkpoint(str(legacy), require_sidecar=False).ok


def test_unsafe_pickles_are_refused_with_the_allow_list_hint_only(tmp_path: pathlib.Path) -> None:
    path = _save(tmp_path / "custom.ckpt", {"state_dict": {}, "hyper_parameters": {"p": pathlib.PurePosixPath("/")}})
    reason = verify_checkpoint(path).reason
    assert reason.startswith("cannot be loaded with weights_only=True: Unsupported global")
    assert "add_safe_globals" in reason
    assert "weights_only=False" not in reason
    assert "weights_only` set to `False" not in reason


def test_last_good_checkpoint_at_or_before_step_skips_later_and_stepless_files(tmp_path: pathlib.Path) -> None:
    now = time.time_ns()
    files: list[tuple[str, dict[str, object]]] = [
        ("step10.ckpt", _ckpt(step=10)),
        ("step30.ckpt", _ckpt(step=30)),  # an abandoned run's future
        ("plain.ckpt", {"layer.weight": torch.ones(2)}),  # no global_step: never a rollback target
        ("nostep.ckpt", {"state_dict": {"w": torch.ones(2)}}),
    ]
    for i, (name, ckpt) in enumerate(files):
        path = _save(tmp_path / name, ckpt)
        os.utime(path, ns=(now + i * 10**9, now + i * 10**9))  # listed in this order, newest last
    assert last_good_checkpoint(str(tmp_path)) == str(tmp_path / "nostep.ckpt")
    assert last_good_checkpoint(str(tmp_path), at_or_before_step=15) == str(tmp_path / "step10.ckpt")
    assert last_good_checkpoint(str(tmp_path), at_or_before_step=30) == str(tmp_path / "step30.ckpt")
    assert last_good_checkpoint(str(tmp_path), at_or_before_step=9) is None
    assert checkpoint_step({"state_dict": {}, "global_step": torch.tensor(7)}) == 7
    assert checkpoint_step({"state_dict": {}, "global_step": True}) is None


def test_rollback_load_is_weights_only_and_refuses_a_later_step(tmp_path: pathlib.Path) -> None:
    later = _save(tmp_path / "later.ckpt", _ckpt(step=30))
    with pytest.raises(CheckpointVerificationError, match=r"global_step=30, after the step being restored to \(15\)"):
        load_rollback_checkpoint(later, at_or_before_step=15)
    assert load_rollback_checkpoint(later, at_or_before_step=30)["global_step"] == 30
    plain = _save(tmp_path / "plain.ckpt", {"layer.weight": torch.ones(2)})
    with pytest.raises(CheckpointVerificationError, match="not a Lightning checkpoint"):
        load_rollback_checkpoint(plain, at_or_before_step=15)
    sentinel = tmp_path / "PWNED"
    evil = _ckpt(step=1)
    evil["hyper_parameters"] = {"x": _Payload(str(sentinel))}
    with pytest.raises(CheckpointVerificationError, match="weights_only=True"):
        load_rollback_checkpoint(_save(tmp_path / "evil.ckpt", evil), at_or_before_step=15)
    assert not sentinel.exists()


class _Payload:
    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.sentinel),))


def test_restore_from_checkpoint_never_loads_a_later_step_into_the_fit(tmp_path: pathlib.Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_nanguard import CheckpointGuard
    from tests.helpers import TinyModel, make_trainer, params_of

    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=4, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=8).fit(TinyModel())
    trainer = make_trainer(tmp_path / "second", max_steps=6)
    model = TinyModel()
    trainer.fit(model)  # global_step is 6 now
    before = params_of(model)
    with pytest.raises(CheckpointVerificationError, match="global_step=8"):
        restore_from_checkpoint(trainer, str(ck / "epoch=0-step=8.ckpt"))
    assert all(torch.equal(before[k], v) for k, v in params_of(model).items())  # nothing was loaded
    done = restore_from_checkpoint(trainer, str(ck / "epoch=0-step=4.ckpt"))
    assert (done.step, done.path) == (4, str(ck / "epoch=0-step=4.ckpt"))
    saved = torch.load(ck / "epoch=0-step=4.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in params_of(model).items())


@pytest.mark.parametrize("guarded", [False, True])
def test_final_checkpoint_is_blessed_only_when_it_verifies(tmp_path: pathlib.Path, guarded: bool) -> None:
    from lightning_nanguard import CheckpointGuard
    from lightning_nanguard.checkpointing.final import save_verified_checkpoint
    from tests.helpers import TinyModel, make_trainer

    callbacks = [CheckpointGuard()] if guarded else []
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=2)
    model = TinyModel()
    trainer.fit(model)
    good = save_verified_checkpoint(trainer, str(tmp_path / "ck"), "final-good.ckpt")
    assert good == str(tmp_path / "ck" / "final-good.ckpt")
    assert verify_checkpoint(good).ok
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    if guarded:
        with pytest.warns(UserWarning, match="refused to write"):
            bad = save_verified_checkpoint(trainer, str(tmp_path / "ck"), "final-bad.ckpt")
    else:
        bad = save_verified_checkpoint(trainer, str(tmp_path / "ck"), "final-bad.ckpt")
    assert bad == ""  # not blessed, and not left behind for a resume to pick up
    assert not (tmp_path / "ck" / "final-bad.ckpt").exists()
    assert not (tmp_path / "ck" / ("final-bad.ckpt" + SIDECAR_SUFFIX)).exists()
