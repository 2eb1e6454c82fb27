"""A buffer that holds infinities by design (a causal mask of -inf) passes every checkpoint check: save, resume,
fallback, disk rollback and ``nanguard verify``; NaN anywhere, and inf in parameters or in buffers that were finite,
stay refused."""

from __future__ import annotations

import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_nanguard import CheckpointGuard, CheckpointVerificationError, default_callbacks, verify_checkpoint
from lightning_nanguard.checkpointing.sidecar import read_sidecar
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME, write_sidecar
from lightning_nanguard.cli import main as nanguard
from lightning_nanguard.engine import get_engine
from lightning_nanguard.exceptions import NonFiniteTrainingError
from tests.helpers import TinyModel, make_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]


class MaskedModel(TinyModel):
    """TinyModel whose hidden units are mixed through a persistent, causal -inf mask (built in ``__init__``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.register_buffer("causal_mask", torch.full((16, 16), float("-inf")).triu(1))
        self.register_buffer("scale", torch.ones(16))  # finite: an infinity here is damage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) * self.scale
        mixed = torch.softmax(h.unsqueeze(1) + self.causal_mask, dim=-1) @ h.unsqueeze(-1)
        return self.head(mixed.squeeze(-1))


def _checkpoints(ck: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in ck.glob("*.ckpt") if p.name != LAST_GOOD_NAME)


def _fit(tmp_path: pathlib.Path, callbacks: list[Callback], **kw: Any) -> pl.Trainer:
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[ck, *callbacks], enable_checkpointing=True, **kw)
    trainer.fit(MaskedModel())
    return trainer


@pytest.mark.parametrize("suite", ["preset", "guard_alone"])
def test_a_mask_of_minus_inf_is_saved_recorded_and_resumed(tmp_path: pathlib.Path, suite: str) -> None:
    callbacks = default_callbacks() if suite == "preset" else [CheckpointGuard(fallback=True)]
    trainer = _fit(tmp_path, callbacks, max_steps=6)  # alone, the guard records the mask itself: no end-of-fit error
    assert [r.action for r in get_engine(trainer).sink.records] == []  # no refused save
    files = _checkpoints(tmp_path / "ck")
    assert [p.name for p in files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    sidecar = read_sidecar(str(files[-1]))
    assert sidecar is not None
    assert sidecar.meta["intended_infinities"] == ["causal_mask"]
    result = verify_checkpoint(str(files[-1]))
    assert (result.ok, result.note) == (True, "")  # recorded: no note needed
    resumed = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard()], max_steps=8)
    resumed.fit(MaskedModel(), ckpt_path=str(files[-1]))
    assert resumed.global_step == 8


def test_a_plain_lightning_checkpoint_of_the_mask_model_resumes_under_the_preset(tmp_path: pathlib.Path) -> None:
    _fit(tmp_path / "plain", [], max_steps=4)  # plain Lightning: no sidecar, no record
    plain = tmp_path / "plain" / "ck" / "epoch=0-step=4.ckpt"
    trainer = make_trainer(tmp_path / "resume", callbacks=default_callbacks(), max_steps=6)
    trainer.fit(MaskedModel(), ckpt_path=str(plain))  # the live module builds the same mask: intended
    assert trainer.global_step == 6
    # Offline, with nothing to compare with, the mask passes with a note that says so.
    result = verify_checkpoint(str(plain), require_sidecar=False)
    assert result.ok
    assert result.note.startswith("causal_mask holds infinities and no NaN, taken as intended")


@pytest.mark.parametrize(
    ("key", "value", "where", "reason"),
    [
        ("causal_mask", float("nan"), (3, 0), "non-finite values in state_dict.causal_mask"),  # NaN: never intended
        ("causal_mask", float("-inf"), (5, 0), "non-finite values in state_dict.causal_mask"),  # a new place
        ("scale", float("inf"), (2,), "non-finite values in state_dict.scale"),  # a buffer that was finite
        ("head.weight", float("inf"), (0, 1), "non-finite values in state_dict.head.weight"),  # a parameter
    ],
)
def test_damage_beside_the_mask_is_still_refused_at_resume(
    tmp_path: pathlib.Path, key: str, value: float, where: tuple[int, ...], reason: str
) -> None:
    _fit(tmp_path, [CheckpointGuard()], max_steps=4)
    bad = tmp_path / "ck" / "epoch=0-step=4.ckpt"
    ckpt = torch.load(bad, weights_only=True)
    ckpt["state_dict"][key][where] = value
    torch.save(ckpt, bad)
    write_sidecar(str(bad))  # a fresh digest, and no record: only the live module can vouch for infinities
    trainer = make_trainer(tmp_path / "resume", callbacks=[CheckpointGuard()], max_steps=6)
    with pytest.raises(CheckpointVerificationError, match=reason):
        trainer.fit(MaskedModel(), ckpt_path=str(bad))
    # The fallback passes the damaged file over and takes the verified one before it, mask and all.
    trainer = make_trainer(tmp_path / "fallback", callbacks=[CheckpointGuard(fallback=True)], max_steps=6)
    with pytest.warns(UserWarning, match=r"loaded .*epoch=0-step=2\.ckpt of step 2"):
        trainer.fit(MaskedModel(), ckpt_path=str(bad))


class _InfIntoBuffer(Callback):
    """At a batch start, an overflow lands in the finite ``scale`` buffer (as a running statistic can overflow)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.scale[0] = float("inf")  # type: ignore[index, operator]


def test_an_infinity_in_a_buffer_that_was_finite_refuses_the_save(tmp_path: pathlib.Path) -> None:
    with (  # alone, the guard refuses; the end of fit says the state is bad
        pytest.raises(NonFiniteTrainingError),
        pytest.warns(UserWarning, match=r"refused to write .*step=4\.ckpt at global_step=4: .* state_dict\.scale"),
    ):
        _fit(tmp_path, [CheckpointGuard(), _InfIntoBuffer(step=3)], max_steps=4)
    assert [p.name for p in _checkpoints(tmp_path / "ck")] == ["epoch=0-step=2.ckpt"]  # 4 was refused


def test_nanguard_verify_notes_an_unrecorded_mask_and_fails_what_the_record_denies(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = MaskedModel()
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": model.state_dict(), "global_step": 3}, plain)
    assert nanguard(["verify", "--no-require-sidecar", str(plain)]) == 0
    assert "causal_mask holds infinities and no NaN, taken as intended" in capsys.readouterr().out
    write_sidecar(str(plain), meta={"intended_infinities": []})  # a record that lists no intended infinities
    assert nanguard(["verify", str(plain)]) == 1
    assert "non-finite values in state_dict.causal_mask" in capsys.readouterr().out


def test_a_disk_rollback_restores_a_checkpoint_of_the_mask_model(tmp_path: pathlib.Path) -> None:
    from lightning_nanguard import AutoRollback
    from lightning_nanguard.testing import FaultInjector

    rb = AutoRollback(source="disk", num_snapshots=0)  # ModelCheckpoint's directory
    trainer = _fit(tmp_path, [CheckpointGuard(), FaultInjector("param", steps=[5]), rb], max_steps=8)
    (incident,) = [r for r in get_engine(trainer).sink.records if r.action == "rollback"]
    assert incident.values["rollback_source"] == "disk"
    assert incident.values["restored_from_step"] == 4


def test_the_record_goes_to_the_sidecar_not_into_the_checkpoint(tmp_path: pathlib.Path) -> None:
    _fit(tmp_path, [CheckpointGuard()], max_steps=2, logger=CSVLogger(str(tmp_path)))
    path = tmp_path / "ck" / "epoch=0-step=2.ckpt"
    ckpt = torch.load(path, weights_only=True)  # weights-only loadable, exactly as Lightning writes it
    assert not any("intended" in str(state) for state in ckpt["callbacks"].values())
    assert isinstance(ckpt["state_dict"]["causal_mask"], torch.Tensor)
