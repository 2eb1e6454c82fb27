"""CheckpointGuard in real Trainer runs: refused NaN saves, top-k retention, verified resumes and fallbacks."""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_nanguard import CheckpointGuard, CheckpointVerificationError, last_good_checkpoint, verify_checkpoint
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME, SIDECAR_SUFFIX, write_sidecar
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO
from lightning_nanguard.engine import get_engine
from lightning_nanguard.exceptions import NanGuardConfigError, NonFiniteTrainingError, UnsupportedSetupError
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer

# The resuming Trainers here leave out the first run's ModelCheckpoint and resume mid-epoch, on purpose.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
]


class Probe(Callback):
    """Records what the Trainer holds when training starts: the resumed step and whether the weights are finite."""

    def __init__(self) -> None:
        self.start: tuple[int, bool] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = (trainer.global_step, all_finite(pl_module))


def _incidents(trainer: pl.Trainer) -> list[dict[str, Any]]:
    return [r.to_dict() for r in get_engine(trainer).sink.records]


def _good_run(tmp_path: pathlib.Path) -> pathlib.Path:
    """A guarded run that leaves verified checkpoints at steps 2 and 4 (plus the tag) in ``tmp_path/ck``."""
    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=-1)
    callbacks = [mc, CheckpointGuard()]
    make_trainer(tmp_path / "first", callbacks=callbacks, enable_checkpointing=True, max_steps=4).fit(TinyModel())
    assert sorted(p.name for p in ck.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", LAST_GOOD_NAME]
    return ck


def _data_offset(path: str, member: Any) -> int:
    """Where a zip member's bytes start: after its local header, whose extra field (torch's alignment padding) can
    differ from the central directory's."""
    import struct

    with open(path, "rb") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return int(member.header_offset + 30 + name_len + extra_len)


def _corrupt(path: pathlib.Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "bitflip":
        flipped = bytearray(path.read_bytes())
        flipped[len(flipped) // 2] ^= 0x10
        path.write_bytes(bytes(flipped))
    elif how == "nan_weights":  # a checksum that matches, over NaN weights: only the finiteness check catches it
        ckpt = torch.load(path, weights_only=True)
        ckpt["state_dict"]["head.weight"].fill_(float("nan"))
        torch.save(ckpt, path)
        write_sidecar(str(path))
    elif how == "no_sidecar":
        os.remove(str(path) + SIDECAR_SUFFIX)


CORRUPTIONS = {
    "truncated": "sha256 does not match",
    "bitflip": "sha256 does not match",
    "nan_weights": "non-finite values in state_dict.head.weight",
    "no_sidecar": "no checksum sidecar",
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_resume_from_bad_checkpoint_raises_before_any_step(tmp_path: pathlib.Path, how: str) -> None:
    ck = _good_run(tmp_path)
    bad = ck / "epoch=0-step=4.ckpt"
    _corrupt(bad, how)
    model, probe = TinyModel(), Probe()
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(), probe], max_steps=6)
    with pytest.raises(CheckpointVerificationError) as info:
        trainer.fit(model, ckpt_path=str(bad))
    message = str(info.value)
    assert str(bad) in message
    assert CORRUPTIONS[how] in message
    assert "What to try" in message
    assert model.losses == []  # not one training step ran
    assert probe.start is None
    refused = [r for r in _incidents(trainer) if r["action"] == "refuse"]
    assert len(refused) == 1
    assert refused[0]["values"]["file"] == str(bad)


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_resume_falls_back_to_newest_verified(tmp_path: pathlib.Path, how: str) -> None:
    ck = _good_run(tmp_path)
    bad = ck / "epoch=0-step=4.ckpt"
    _corrupt(bad, how)
    model, probe = TinyModel(), Probe()
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(fallback=True), probe], max_steps=6)
    with pytest.warns(UserWarning, match="failed verification"):
        trainer.fit(model, ckpt_path=str(bad))
    # A file that only lost its sidecar falls back to the tag (same content, own sidecar); corrupt content to step 2.
    expected_file = ck / (LAST_GOOD_NAME if how == "no_sidecar" else "epoch=0-step=2.ckpt")
    expected_step = 4 if how == "no_sidecar" else 2
    assert probe.start == (expected_step, True)
    assert trainer.global_step == 6
    assert len(model.losses) == 6 - expected_step
    fallbacks = [r for r in _incidents(trainer) if r["action"] == "fallback"]
    assert len(fallbacks) == 1
    assert fallbacks[0]["values"]["file"] == str(bad)
    assert fallbacks[0]["values"]["loaded"] == str(expected_file)
    assert fallbacks[0]["step"] == expected_step


def test_fallback_without_any_verified_file_raises(tmp_path: pathlib.Path) -> None:
    ck = _good_run(tmp_path)
    for path in ck.glob("*.ckpt"):
        if path.name != LAST_GOOD_NAME:
            _corrupt(path, "bitflip")  # the tag shares its inode with step 4, so it is corrupt too
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(fallback=True)], max_steps=6)
    with pytest.raises(CheckpointVerificationError, match="nothing to fall back to"):
        trainer.fit(TinyModel(), ckpt_path=str(ck / "epoch=0-step=4.ckpt"))


def test_require_sidecar_false_accepts_a_plain_lightning_checkpoint(tmp_path: pathlib.Path) -> None:
    plain = make_trainer(tmp_path / "plain", max_steps=2)
    plain.fit(TinyModel())
    path = str(tmp_path / "plain.ckpt")
    plain.save_checkpoint(path)  # no CheckpointGuard: no sidecar
    probe = Probe()
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(require_sidecar=False), probe], max_steps=3)
    trainer.fit(TinyModel(), ckpt_path=path)
    assert probe.start == (2, True)


@pytest.mark.parametrize(
    ("save_top_k", "precision"), [(1, "32-true"), (3, "32-true"), (1, "bf16-mixed"), (1, "16-mixed"), (1, "bf16-true")]
)
def test_nonfinite_checkpoint_is_refused_and_last_good_survives_retention(
    tmp_path: pathlib.Path, save_top_k: int, precision: str
) -> None:
    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=1, save_top_k=save_top_k, monitor="step", mode="max")
    callbacks = [mc, CheckpointGuard(), FaultInjector("param", steps=[3], value="nan")]
    trainer = make_trainer(tmp_path, precision, callbacks=callbacks, enable_checkpointing=True, max_steps=7)
    # Nothing here can restore the NaN weights: the saves are refused, and the fit ends with the documented error.
    with (
        pytest.warns(UserWarning, match="CheckpointGuard refused to write") as caught,
        pytest.raises(NonFiniteTrainingError, match="training ended with non-finite parameters"),
    ):
        trainer.fit(TinyModel())
    assert not all_finite(trainer.lightning_module)  # the run did go NaN (nothing here rolls it back)
    refused = [r for r in _incidents(trainer) if r["action"] == "refuse"]
    assert [r["step"] for r in refused] == [4, 5, 6, 7]
    assert all(r["trigger"] == "nonfinite_checkpoint" for r in refused)
    assert "state_dict." in refused[0]["values"]["nonfinite_tensors"]
    # ModelCheckpoint asked to delete its top-k files up to step 3 (it believes the refused 4-7 exist): removals wait
    # for a finite save, so the numbered files survive next to the tag, and the warning names step 3 truthfully.
    step3 = ck / "epoch=0-step=3.ckpt"
    kept = [f"epoch=0-step={s}.ckpt" for s in range(4 - save_top_k, 4)]
    assert sorted(p.name for p in ck.glob("epoch=*.ckpt")) == kept
    assert all(verify_checkpoint(str(ck / name)).ok for name in kept)
    assert last_good_checkpoint(str(ck)) == str(step3)
    for good in (step3, ck / LAST_GOOD_NAME):
        assert torch.load(good, weights_only=True)["global_step"] == 3
        assert verify_checkpoint(str(good)).ok
    messages = [str(w.message) for w in caught if "refused to write" in str(w.message)]
    assert all(f"the newest good checkpoint stays at {step3}" in m for m in messages)


def test_save_checkpoint_is_atomic_with_sidecar_and_tag(tmp_path: pathlib.Path) -> None:
    guard = CheckpointGuard()
    trainer = make_trainer(tmp_path, callbacks=[guard], max_steps=2)
    trainer.fit(TinyModel())
    target = tmp_path / "out" / "final.ckpt"
    trainer.save_checkpoint(str(target))  # after fit: the wrapper is still installed
    assert isinstance(trainer.strategy.checkpoint_io, VerifyingCheckpointIO)
    assert verify_checkpoint(str(target)).ok
    assert sorted(os.listdir(target.parent)) == [
        "final.ckpt",
        "final.ckpt" + SIDECAR_SUFFIX,
        LAST_GOOD_NAME,
        LAST_GOOD_NAME + SIDECAR_SUFFIX,
    ]
    assert os.path.samefile(target, target.parent / LAST_GOOD_NAME)  # a hard link: no extra disk
    assert guard.last_saved == str(target)


def test_second_fit_reuses_the_wrapper(tmp_path: pathlib.Path) -> None:
    guard = CheckpointGuard()
    trainer = make_trainer(tmp_path, callbacks=[guard], max_steps=1)
    trainer.fit(TinyModel())
    first = trainer.strategy.checkpoint_io
    trainer.fit(TinyModel())  # setup runs again
    assert trainer.strategy.checkpoint_io is first
    assert not isinstance(first.checkpoint_io, VerifyingCheckpointIO)  # type: ignore[attr-defined]


def test_weights_only_refuses_custom_hparams_until_allow_listed(tmp_path: pathlib.Path) -> None:
    class PathModel(TinyModel):
        def __init__(self, root: pathlib.Path = pathlib.Path("/data")) -> None:
            super().__init__()
            self.save_hyperparameters()

    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=2).fit(PathModel())
    path = str(ck / "epoch=0-step=2.ckpt")
    with pytest.raises(CheckpointVerificationError, match="add_safe_globals"):
        make_trainer(tmp_path, callbacks=[CheckpointGuard()], max_steps=3).fit(PathModel(), ckpt_path=path)
    probe = Probe()
    with torch.serialization.safe_globals([type(pathlib.Path("/data"))]):
        make_trainer(tmp_path, callbacks=[CheckpointGuard(), probe], max_steps=3).fit(PathModel(), ckpt_path=path)
    assert probe.start == (2, True)


def test_state_round_trip_with_weights_only(tmp_path: pathlib.Path) -> None:
    guard = CheckpointGuard()
    guard.refused_saves = 2
    trainer = make_trainer(tmp_path, callbacks=[guard], max_steps=1)
    trainer.fit(TinyModel())
    first, second = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    trainer.save_checkpoint(first)
    trainer.save_checkpoint(second)  # its state was dumped after the first save completed
    state = torch.load(second, weights_only=True)["callbacks"][guard.state_key]
    restored = CheckpointGuard()
    restored.load_state_dict(state)
    assert restored.refused_saves == 2
    assert restored.last_saved == first
    CheckpointGuard().load_state_dict({})  # tolerant of older/missing state


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"require_sidecar": "yes"}, "CheckpointGuard(require_sidecar='yes'): must be True or False"),
        ({"require_sidecar": 0}, "CheckpointGuard(require_sidecar=0): must be True or False"),
        ({"fallback": 1}, "CheckpointGuard(fallback=1): must be True or False"),
        ({"fallback": 1.5}, "CheckpointGuard(fallback=1.5): must be True or False"),
        ({"tag_last_good": None}, "CheckpointGuard(tag_last_good=None): must be True or False"),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(NanGuardConfigError) as info:
        CheckpointGuard(**kwargs)
    assert text in str(info.value)


def test_async_checkpoint_io_is_refused(tmp_path: pathlib.Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], plugins=[AsyncCheckpointIO()], max_steps=1)
    with pytest.raises(UnsupportedSetupError, match="AsyncCheckpointIO"):
        trainer.fit(TinyModel())


def test_validate_with_a_bad_checkpoint_is_refused_too(tmp_path: pathlib.Path) -> None:
    ck = _good_run(tmp_path)
    bad = ck / "epoch=0-step=4.ckpt"
    _corrupt(bad, "nan_weights")
    trainer = make_trainer(tmp_path / "val", callbacks=[CheckpointGuard()], limit_val_batches=1)
    with pytest.raises(CheckpointVerificationError, match=r"non-finite values in state_dict\.head\.weight"):
        trainer.validate(TinyModel(), ckpt_path=str(bad))
    trainer = make_trainer(tmp_path / "val", callbacks=[CheckpointGuard(fallback=True)], limit_val_batches=1)
    with pytest.warns(UserWarning, match="loaded .*epoch=0-step=2.ckpt"):
        trainer.validate(TinyModel(), ckpt_path=str(bad))


# ---------------------------------------------------------------------------------------------------------------------
# Regressions from the reliability floor (issue 12, part C): nothing lost, nothing unpickled, nothing bad blessed.


class _Payload:
    """Unpickling it creates ``sentinel``: the proof that a file was loaded with weights_only=False."""

    def __init__(self, sentinel: str) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.sentinel),))


@pytest.mark.parametrize("weights_only", [None, False])
def test_fallback_never_unpickles_another_file_whatever_the_caller_allowed(
    tmp_path: pathlib.Path, weights_only: bool | None
) -> None:
    ck = _good_run(tmp_path)
    sentinel = tmp_path / "PWNED"
    planted = torch.load(ck / "epoch=0-step=4.ckpt", weights_only=True)
    planted["hyper_parameters"] = {"x": _Payload(str(sentinel))}
    evil = ck / "zz-planted.ckpt"
    torch.save(planted, evil)
    write_sidecar(str(evil))  # a "valid" sidecar is only the file's own sha256
    os.utime(evil, ns=(10**19, 10**19))  # the newest file of the directory: the first fallback candidate
    mine = ck / "epoch=0-step=4.ckpt"
    _corrupt(mine, "truncated")
    probe = Probe()
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(fallback=True), probe], max_steps=6)
    with pytest.warns(UserWarning, match="failed verification"):
        trainer.fit(TinyModel(), ckpt_path=str(mine), weights_only=weights_only)
    assert not sentinel.exists()  # the planted payload never ran
    fallbacks = [r for r in _incidents(trainer) if r["action"] == "fallback"]
    assert [r["values"]["loaded"] for r in fallbacks] == [str(ck / "epoch=0-step=2.ckpt")]  # step 4 shares the damage
    assert probe.start == (2, True)


class _Custom:
    """A custom type in hyperparameters: loadable only with weights_only=False."""


def test_weights_only_false_still_applies_to_the_file_the_user_named(tmp_path: pathlib.Path) -> None:
    ck = _good_run(tmp_path)
    mine = ck / "epoch=0-step=4.ckpt"
    ckpt = torch.load(mine, weights_only=True)
    ckpt["hyper_parameters"] = {"custom": _Custom()}
    torch.save(ckpt, mine)
    write_sidecar(str(mine))
    probe = Probe()
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(fallback=True), probe], max_steps=5)
    trainer.fit(TinyModel(), ckpt_path=str(mine), weights_only=False)  # the user trusts this file
    assert probe.start == (4, True)
    assert _incidents(trainer) == []


@pytest.mark.parametrize("tag_last_good", [False, True])
def test_refused_saves_never_let_retention_delete_the_last_good_file(
    tmp_path: pathlib.Path, tag_last_good: bool
) -> None:
    ck = tmp_path / "ck"
    callbacks = [
        FaultInjector("param", steps=[12]),
        CheckpointGuard(tag_last_good=tag_last_good),
        ModelCheckpoint(dirpath=str(ck), every_n_train_steps=5, save_top_k=1),
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=20)
    # Nothing here can restore the NaN weights: the saves are refused, and the fit ends with the documented error.
    with (
        pytest.warns(UserWarning, match="CheckpointGuard refused to write") as caught,
        pytest.raises(NonFiniteTrainingError, match="training ended with non-finite parameters"),
    ):
        trainer.fit(TinyModel())
    step10 = ck / "epoch=1-step=10.ckpt"
    assert sorted(p.name for p in ck.glob("epoch=*.ckpt")) == [step10.name]  # step 5: retired by a good save
    assert last_good_checkpoint(str(ck)) == str(step10)
    assert torch.load(step10, weights_only=True)["global_step"] == 10
    assert (ck / LAST_GOOD_NAME).exists() == tag_last_good
    refusals = [str(w.message) for w in caught if "refused to write" in str(w.message)]
    assert len(refusals) == 2  # steps 15 and 20
    assert all(f"the newest good checkpoint stays at {step10}" in m for m in refusals)  # and it does
    assert [r["values"]["kept"] for r in _incidents(trainer) if r["action"] == "refuse"] == [str(step10)] * 2


def test_a_good_save_after_a_refusal_carries_out_the_deferred_removals(tmp_path: pathlib.Path) -> None:
    class HealOnce(Callback):
        """Puts the weights and optimizer state back to finite values after step 7, as a rollback would."""

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if trainer.global_step == 7:
                self.seen = sorted(p.name for p in ck.glob("*.ckpt"))
                with torch.no_grad():
                    for p in pl_module.parameters():
                        p.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
                        for t in trainer.optimizers[0].state[p].values():
                            if t.is_floating_point():
                                t.nan_to_num_(0.0, posinf=0.0, neginf=0.0)

    ck = tmp_path / "ck"
    heal = HealOnce()
    callbacks = [
        FaultInjector("param", steps=[4]),
        heal,
        CheckpointGuard(tag_last_good=False),
        ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=1),
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=8)
    with pytest.warns(UserWarning, match="CheckpointGuard refused to write"):
        trainer.fit(TinyModel())  # healed: the fit ends finite
    assert heal.seen == ["epoch=0-step=4.ckpt"]  # step 6 was refused; its removal of step 4 waited
    # The NaN lands after the step-4 save: step 6 is refused (its removal of step 4 waits); after the heal at step 7,
    # step 8 is saved and the deferred removal is carried out: top-1 holds only the newest file again.
    assert sorted(p.name for p in ck.iterdir()) == ["epoch=0-step=8.ckpt", "epoch=0-step=8.ckpt" + SIDECAR_SUFFIX]


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
@pytest.mark.parametrize("fallback", [False, True])
def test_missing_ckpt_path_raises_file_not_found_as_lightning_does(
    tmp_path: pathlib.Path, stage: str, fallback: bool
) -> None:
    ck = _good_run(tmp_path)  # a directory with verified files: a missing name is still an error, not a fallback
    trainer = make_trainer(tmp_path / "run", callbacks=[CheckpointGuard(fallback=fallback)], limit_val_batches=1)
    model = TinyModel()
    model.test_step = model.validation_step  # type: ignore[method-assign]
    model.test_dataloader = model.val_dataloader  # type: ignore[method-assign]
    model.predict_dataloader = model.val_dataloader  # type: ignore[method-assign]
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt"):
        getattr(trainer, stage)(model, ckpt_path=str(ck / "missing.ckpt"))
    assert model.losses == []


class _Spectral(pl.LightningModule):
    """A complex-valued weight (spectral layers, complex nets), trained by Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.cfloat) * 0.1)
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head((x.to(torch.cfloat) @ self.w).abs()), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return TinyModel().train_dataloader()


def test_complex_nan_weights_are_refused_and_the_tag_stays_on_the_good_file(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    callbacks = [
        FaultInjector("param", steps=[6], param_name="w"),
        CheckpointGuard(),
        ModelCheckpoint(dirpath=str(ck), every_n_train_steps=4, save_top_k=-1),
    ]
    trainer = make_trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=12)
    with (
        pytest.warns(UserWarning, match=r"refused to write .*non-finite values in state_dict\.w"),
        pytest.raises(NonFiniteTrainingError, match=r"training ended with non-finite parameters .*\bw\b"),
    ):
        trainer.fit(_Spectral())
    assert sorted(p.name for p in ck.glob("epoch=*.ckpt")) == ["epoch=0-step=4.ckpt"]
    assert [r["step"] for r in _incidents(trainer) if r["action"] == "refuse"] == [8, 12]
    tag = torch.load(ck / LAST_GOOD_NAME, weights_only=True)
    assert tag["global_step"] == 4
    assert bool(torch.isfinite(torch.view_as_real(tag["state_dict"]["w"])).all())
    # A complex NaN in a file is caught at load time too.
    bad = tmp_path / "complex-nan.ckpt"
    tag["state_dict"]["w"][0, 0] = complex(float("nan"), 0.0)
    torch.save(tag, bad)
    write_sidecar(str(bad))
    assert verify_checkpoint(str(bad)).reason == "non-finite values in state_dict.w"


def test_a_later_run_removes_the_temporary_files_of_killed_saves(tmp_path: pathlib.Path) -> None:
    import socket
    import subprocess
    import sys

    ck = tmp_path / "ck"
    ck.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    host = socket.gethostname()
    orphans = [f".epoch=0-step=6.ckpt.{pid}@{host}.tmp", f".epoch=0-step=8.ckpt.{pid}.tmp"]  # ours (old name too)
    kept = [
        f".epoch=0-step=6.ckpt.{pid}@another-host.tmp",  # another host's save may be in progress
        ".notes.tmp",  # not ours
        "user.tmp",
    ]
    for name in orphans + kept:
        (ck / name).write_bytes(b"x" * 1024)
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=1)
    make_trainer(tmp_path, callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=2).fit(TinyModel())
    assert sorted(p.name for p in ck.glob("*.tmp")) == sorted(kept)
    old = time.time() - 2 * 3600  # a foreign file becomes stale with age
    os.utime(ck / kept[0], (old, old))
    make_trainer(tmp_path, callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=2).fit(TinyModel())
    assert sorted(p.name for p in ck.glob("*.tmp")) == sorted(kept[1:])


def test_bit_flip_in_a_tensor_is_caught_without_a_sidecar_and_no_unsafe_advice(tmp_path: pathlib.Path) -> None:
    import zipfile

    plain = make_trainer(tmp_path / "plain", max_steps=2)
    plain.fit(TinyModel())
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(str(path))  # no CheckpointGuard: no sidecar
    with zipfile.ZipFile(path) as archive:  # the bytes of the largest tensor
        member = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        offset = _data_offset(str(path), member)
    flipped = bytearray(path.read_bytes())
    flipped[offset + member.file_size // 2] ^= 0x01  # torch.load itself would not notice
    path.write_bytes(bytes(flipped))
    model = TinyModel()
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard(require_sidecar=False)], max_steps=3)
    with pytest.raises(CheckpointVerificationError, match="CRC-32 mismatch in zip member") as info:
        trainer.fit(model, ckpt_path=str(path))
    assert "weights_only=False" not in str(info.value)
    assert model.losses == []


def test_disk_rollback_never_restores_a_later_step(tmp_path: pathlib.Path) -> None:
    from lightning_nanguard import AutoRollback, GradNormMonitor

    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=10, save_top_k=-1)
    make_trainer(tmp_path, callbacks=[CheckpointGuard(), mc], enable_checkpointing=True, max_steps=30).fit(TinyModel())
    # The newest files are the abandoned run's step 30 (and the tag on it) and a plain state dict with a sidecar.
    plain = ck / "weights-only.ckpt"
    torch.save(TinyModel().state_dict(), plain)
    write_sidecar(str(plain))
    # Resume from step 10; a NaN weight at step 15, before any in-memory snapshot: the rollback goes to disk.
    callbacks = [FaultInjector("param", steps=[15]), GradNormMonitor(), AutoRollback(checkpoint_dir=str(ck))]
    trainer = make_trainer(tmp_path / "resume", callbacks=[*callbacks, CheckpointGuard()], max_steps=18)
    trainer.fit(TinyModel(), ckpt_path=str(ck / "epoch=1-step=10.ckpt"))
    rollbacks = [r for r in _incidents(trainer) if "rollback" in r["actions"]]
    assert len(rollbacks) == 1
    values = rollbacks[0]["values"]
    assert values["restored_from_step"] == 10 <= rollbacks[0]["step"]
    assert values["checkpoint"] == str(ck / "epoch=1-step=10.ckpt")
    assert all_finite(trainer.lightning_module)


def test_nothing_is_written_into_the_working_directory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], default_root_dir=None, max_steps=2)
    trainer.fit(TinyModel())
    assert list(cwd.iterdir()) == []
