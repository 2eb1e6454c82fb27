"""CheckpointGuard in real Trainer runs: refused NaN saves, top-k retention, verified resumes and fallbacks."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_nanguard import CheckpointGuard, CheckpointVerificationError, last_good_checkpoint, verify_checkpoint
from lightning_nanguard.checkpoints import LAST_GOOD_NAME, SIDECAR_SUFFIX, write_sidecar
from lightning_nanguard.engine import get_engine
from lightning_nanguard.exceptions import NanGuardConfigError, UnsupportedSetupError
from lightning_nanguard.recovery.verifying_io import VerifyingCheckpointIO
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


def _corrupt(path: pathlib.Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "bitflip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
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
    with pytest.warns(UserWarning, match="CheckpointGuard refused to write") as caught:
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
        "final.ckpt.sha256",
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
