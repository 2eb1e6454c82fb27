"""VerifyingCheckpointIO: a crash (SIGKILL, or an error between rename and sidecar) never leaves a file that verifies
unless it is complete; removals take their sidecars; loads pass weights_only=True through."""

from __future__ import annotations

import io
import os
import pathlib
import signal
import time
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_nanguard.checkpointing import tmp_files, verifying_io
from lightning_nanguard.checkpointing import verify as checkpoints
from lightning_nanguard.checkpointing.events import CheckpointEvent
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME, SIDECAR_SUFFIX, checkpoint_files, verify_checkpoint
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO
from lightning_nanguard.exceptions import CheckpointVerificationError


def _slow_write(checkpoint: dict[str, Any], path: Any, signal_fd: int) -> None:
    """Write in small flushed chunks; on the save of ``global_step == 1`` signal the parent midway and stall."""
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    data, chunk = buf.getvalue(), 1 << 16
    with open(path, "wb") as f:
        for i in range(0, len(data), chunk):
            f.write(data[i : i + chunk])
            f.flush()
            if i == 4 * chunk and checkpoint["global_step"] == 1:
                os.write(signal_fd, b"M")
                time.sleep(30)  # SIGKILLed here, with half the file written


class SlowIO(TorchCheckpointIO):
    """A plugin that writes in place at the path it is given (as ``torch.save(checkpoint, path)`` does)."""

    def __init__(self, signal_fd: int) -> None:
        self.signal_fd = signal_fd

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        _slow_write(checkpoint, path, self.signal_fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork and SIGKILL (POSIX)")
@pytest.mark.parametrize("writer", ["lightning_io", "plugin_in_place"])
def test_sigkill_mid_save_never_leaves_a_file_that_verifies_unless_complete(
    tmp_path: pathlib.Path, writer: str
) -> None:
    # A forked child (no second interpreter start-up: well under a second) saves a complete checkpoint, then
    # overwrites it through a slow write and is SIGKILLed halfway through. Lightning's own TorchCheckpointIO writes
    # through nanguard's temporary name; a plugin is handed the path itself and writes over the file in place.
    target = tmp_path / "last.ckpt"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read_fd)
            if writer == "lightning_io":
                from lightning.fabric.plugins.io import torch_io

                torch_io._atomic_save = lambda ckpt, path: _slow_write(ckpt, path, write_fd)  # type: ignore[assignment]
                guarded = VerifyingCheckpointIO(TorchCheckpointIO())
            else:
                guarded = VerifyingCheckpointIO(SlowIO(write_fd))
            ckpt: dict[str, Any] = {"global_step": 0, "state_dict": {"w": torch.randn(1 << 19)}}
            guarded.save_checkpoint(ckpt, str(target))
            ckpt = {"global_step": 1, "state_dict": {"w": torch.randn(1 << 19)}}
            guarded.save_checkpoint(ckpt, str(target))
        finally:
            os._exit(1)
    os.close(write_fd)
    try:
        assert os.read(read_fd, 1) == b"M"
    finally:
        os.close(read_fd)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert os.WTERMSIG(status) == signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    tag = str(tmp_path / LAST_GOOD_NAME)
    assert sorted(checkpoint_files(str(tmp_path))) == sorted([str(target), tag])
    assert verify_checkpoint(tag).ok  # the tag holds the complete, older save either way
    assert torch.load(tag, weights_only=True)["global_step"] == 0
    if writer == "lightning_io":
        host = tmp_files.host_name()
        assert leftovers == [os.path.basename(tmp_files.tmp_name(str(target))).replace(f".{os.getpid()}@", f".{pid}@")]
        assert leftovers[0].startswith(".nanguard-")  # hidden
        assert leftovers[0].endswith(f".{pid}@{host}.tmp")  # names its writer
        assert "last.ckpt" not in leftovers[0]  # nor the target's name (Lightning reads digits out of names)
        assert verify_checkpoint(str(target)).ok
        assert torch.load(str(target), weights_only=True)["global_step"] == 0
    else:
        assert leftovers == []
        assert "no checksum sidecar" in verify_checkpoint(str(target)).reason  # the old one was removed first
        assert "corrupt or truncated" in verify_checkpoint(str(target), require_sidecar=False).reason
    # A later run's first save into the directory removes the orphan (its writer is gone); nothing else is touched.
    VerifyingCheckpointIO(TorchCheckpointIO()).save_checkpoint({"state_dict": {"w": torch.ones(2)}}, str(target))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert verify_checkpoint(str(target)).ok


def test_stale_tmp_cleanup_touches_only_our_files_not_in_use(tmp_path: pathlib.Path) -> None:
    me, host = os.getpid(), tmp_files.host_name()
    names = {
        f".a.ckpt.{me}@{host}.tmp": True,  # ours, this process, not being written
        f".a.ckpt.{me}@{host}-busy.tmp": False,  # another host: left alone while recent
        f".b.ckpt.{2**22 + 12345}@{host}.tmp": True,  # a writer of this host that is gone
        f".c.ckpt.{2**22 + 12345}.tmp": True,  # an older nanguard's name
        "c.ckpt.sha256.tmp": False,  # a sidecar being written: only by age
        f".nanguard-0123456789abcdef.{me}@{host}.tmp": True,  # the current name, this process, not being written
        f".nanguard-0123456789abcdef.{2**22 + 7}@elsewhere.tmp": False,  # another host's: left alone while recent
        ".d.ckpt.tmp": False,  # not ours
        "notes.tmp": False,
        f".e.ckpt.{me}@{host}-x.tmp": False,
    }
    busy = str(tmp_path / f".f.ckpt.{me}@{host}.tmp")
    for name in [*names, os.path.basename(busy)]:
        (tmp_path / name).write_bytes(b"x")
    removed = tmp_files.remove_stale_tmp_files(str(tmp_path), in_use={busy})
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n, gone in names.items() if gone)
    assert os.path.exists(busy)  # being written by this process now
    old = time.time() - tmp_files.STALE_TMP_SECONDS - 60
    for name in (f".a.ckpt.{me}@{host}-busy.tmp", "c.ckpt.sha256.tmp", "notes.tmp"):
        os.utime(tmp_path / name, (old, old))
    removed = tmp_files.remove_stale_tmp_files(str(tmp_path), in_use={busy})
    assert sorted(os.path.basename(p) for p in removed) == [f".a.ckpt.{me}@{host}-busy.tmp", "c.ckpt.sha256.tmp"]


def test_crash_between_rename_and_sidecar_leaves_a_whole_file_verified_on_its_own(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = VerifyingCheckpointIO(TorchCheckpointIO())
    target = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"global_step": 0, "state_dict": {"w": torch.ones(3)}}, target)

    def crash(path: str, **kwargs: Any) -> str:
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(verifying_io, "write_sidecar", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(3)}}, target)
    assert torch.load(target, weights_only=True)["global_step"] == 1  # the new bytes landed, whole (fsync, rename)
    result = verify_checkpoint(target)  # the old sidecar is stale: the file is verified on its own
    assert result.ok
    assert "last.ckpt.checksum is stale" in result.note
    assert checkpoints.last_good_checkpoint(str(tmp_path)) == target
    tag = str(tmp_path / LAST_GOOD_NAME)  # the tag still holds the complete previous save, and vouches for it
    assert verify_checkpoint(tag).ok
    assert torch.load(tag, weights_only=True)["global_step"] == 0


def test_refused_save_writes_nothing_and_reports(tmp_path: pathlib.Path) -> None:
    events: list[CheckpointEvent] = []
    io = VerifyingCheckpointIO(TorchCheckpointIO(), listener=events.append)
    target = tmp_path / "x.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.tensor([1.0, float("nan")])}}, str(target))
    assert list(tmp_path.iterdir()) == []
    assert [(e.kind, e.tensors) for e in events] == [("refused_save", ("state_dict.w",))]


def test_remove_takes_the_sidecar_and_keeps_the_tag(tmp_path: pathlib.Path) -> None:
    io = VerifyingCheckpointIO(TorchCheckpointIO())
    target = str(tmp_path / "x.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, target)
    io.remove_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LAST_GOOD_NAME, LAST_GOOD_NAME + SIDECAR_SUFFIX]
    assert verify_checkpoint(str(tmp_path / LAST_GOOD_NAME)).ok


def test_load_passes_weights_only_true_and_keeps_map_location_default(tmp_path: pathlib.Path) -> None:
    seen: list[dict[str, Any]] = []

    class Recording(TorchCheckpointIO):
        def load_checkpoint(self, path: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            seen.append(kwargs)
            return super().load_checkpoint(path, **kwargs)

    io = VerifyingCheckpointIO(Recording())
    target = str(tmp_path / "x.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, target)
    assert io.load_checkpoint(target)["state_dict"]["w"].tolist() == [1.0, 1.0]
    io.load_checkpoint(target, weights_only=False, map_location="cpu")
    assert seen == [{"weights_only": True}, {"weights_only": False, "map_location": "cpu"}]


def test_load_error_names_the_file_reason_and_the_verified_alternative(tmp_path: pathlib.Path) -> None:
    io = VerifyingCheckpointIO(TorchCheckpointIO(), tag_last_good=False)
    good, bad = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, good)
    torch.save({"state_dict": {"w": torch.ones(2)}}, bad)  # written without the guard: no sidecar
    with pytest.raises(CheckpointVerificationError) as info:
        io.load_checkpoint(bad)
    message = str(info.value)
    assert f"checkpoint {bad} failed verification: no checksum sidecar" in message
    assert f"resume from the newest verified checkpoint of that directory, {good}" in message
    assert f"nanguard verify --write-sidecar {bad}" in message


def test_remote_paths_get_the_finiteness_check_and_one_notice() -> None:
    events: list[CheckpointEvent] = []
    io = VerifyingCheckpointIO(TorchCheckpointIO(), listener=events.append)
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, "memory://nanguard-test/a.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, "memory://nanguard-test/b.ckpt")
    assert io.load_checkpoint("memory://nanguard-test/a.ckpt")["state_dict"]["w"].tolist() == [1.0, 1.0]
    assert [e.kind for e in events] == ["unverified"]  # told once, not per save
    TorchCheckpointIO().save_checkpoint(
        {"state_dict": {"w": torch.full((2,), float("inf"))}}, "memory://nanguard-test/c.ckpt"
    )
    with pytest.raises(CheckpointVerificationError, match=r"non-finite values in state_dict\.w"):
        io.load_checkpoint("memory://nanguard-test/c.ckpt")


def test_fallback_candidates_load_weights_only_whatever_the_caller_passed(tmp_path: pathlib.Path) -> None:
    seen: list[tuple[str, Any]] = []

    class Recording(TorchCheckpointIO):
        def load_checkpoint(self, path: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            seen.append((os.path.basename(str(path)), kwargs.get("weights_only")))
            return super().load_checkpoint(path, **kwargs)

    io = VerifyingCheckpointIO(Recording(), fallback=True, tag_last_good=False)
    good, mine = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, good)
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.ones(2)}}, mine)
    pathlib.Path(mine).write_bytes(pathlib.Path(mine).read_bytes()[:100])  # damaged: its sha256 fails first
    os.utime(good, ns=(10**19, 10**19))
    assert io.load_checkpoint(mine, weights_only=False)["state_dict"]["w"].tolist() == [1.0, 1.0]
    assert seen == [("a.ckpt", True)]  # the user's weights_only=False never reached the file nanguard chose


def test_missing_file_is_file_not_found_even_with_fallback(tmp_path: pathlib.Path) -> None:
    io = VerifyingCheckpointIO(TorchCheckpointIO(), fallback=True)
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, str(tmp_path / "a.ckpt"))
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*missing\.ckpt"):
        io.load_checkpoint(str(tmp_path / "missing.ckpt"))


def test_removals_after_a_refused_save_wait_for_the_next_good_save(tmp_path: pathlib.Path) -> None:
    events: list[CheckpointEvent] = []
    io = VerifyingCheckpointIO(TorchCheckpointIO(), tag_last_good=False, listener=events.append)
    a, b, c, d = (str(tmp_path / f"{n}.ckpt") for n in "abcd")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, a)
    io.save_checkpoint({"state_dict": {"w": torch.full((2,), float("nan"))}}, b)  # refused
    assert events[-1].kind == "refused_save"
    assert events[-1].kept == a  # the warning names a file that exists, and will keep existing
    io.remove_checkpoint(a)  # retention replacing a by the b it believes exists
    io.remove_checkpoint(b)  # a phantom: nothing to do
    assert os.path.isfile(a)
    assert verify_checkpoint(a).ok
    assert [e.kind for e in events][-1] == "kept"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, c)  # good again: the deferred removal happens now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt", "c.ckpt" + SIDECAR_SUFFIX]
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, d)
    io.remove_checkpoint(c)  # no refusal pending: an ordinary removal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.ckpt", "d.ckpt" + SIDECAR_SUFFIX]


def test_ddp_spawn_weight_transfer_passes_through_untouched() -> None:
    import tempfile

    io = VerifyingCheckpointIO(TorchCheckpointIO())
    transfer = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")  # what ddp_spawn's launcher writes
    io.save_checkpoint({"w": torch.full((2,), float("nan"))}, transfer)  # the state as it is, not a checkpoint
    assert os.listdir(os.path.dirname(transfer)) == [".temp.ckpt"]  # no sidecar, no tag to leak
    assert io.load_checkpoint(transfer)["w"].isnan().all()
    io.remove_checkpoint(transfer)
    assert os.listdir(os.path.dirname(transfer)) == []
    os.rmdir(os.path.dirname(transfer))


def test_dangling_symlink_is_a_failed_verification_so_fallback_applies(tmp_path: pathlib.Path) -> None:
    io = VerifyingCheckpointIO(TorchCheckpointIO(), tag_last_good=False)
    good = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.ones(2)}}, good)
    link = tmp_path / "last.ckpt"  # save_last="link" pointing at a save that was refused
    os.symlink("refused.ckpt", link)
    with pytest.raises(CheckpointVerificationError, match=r"symlink to refused\.ckpt, which does not exist"):
        io.load_checkpoint(str(link))
    io.fallback = True
    assert io.load_checkpoint(str(link))["state_dict"]["w"].tolist() == [1.0, 1.0]


def test_fallback_never_moves_past_the_step_asked_for(tmp_path: pathlib.Path) -> None:
    io = VerifyingCheckpointIO(TorchCheckpointIO(), fallback=True, tag_last_good=False)
    paths = {step: str(tmp_path / f"epoch=0-step={step}.ckpt") for step in (2, 4, 30)}
    for step, path in paths.items():
        io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((2,), float(step))}}, path)
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.ckpt")  # no global_step: never a resume fallback
    checkpoints.write_sidecar(str(tmp_path / "plain.ckpt"))
    # Resuming from step 4 to leave what came later: step 4 is damaged, so step 2 it is, never step 30.
    pathlib.Path(paths[4]).write_bytes(pathlib.Path(paths[4]).read_bytes()[:50])
    assert io.load_checkpoint(paths[4])["global_step"] == 2
    pathlib.Path(paths[2]).write_bytes(pathlib.Path(paths[2]).read_bytes()[:50])
    with pytest.raises(CheckpointVerificationError) as info:
        io.load_checkpoint(paths[4])
    assert "no checkpoint of" in str(info.value)
    assert "at or before step 4 verifies; the newer verified ones (epoch=0-step=30.ckpt) were not used" in str(
        info.value
    )
    assert checkpoints.step_in_name("last.ckpt") is None
    assert checkpoints.step_in_name("model-global_step=7-v1.ckpt") == 7
