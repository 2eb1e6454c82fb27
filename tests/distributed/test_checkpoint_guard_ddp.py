"""CheckpointGuard under DDP (2 CPU processes, gloo): every rank falls back to the same verified file; rank 0 writes
sidecars and refuses the non-finite checkpoint."""

from __future__ import annotations

import json
import os
import pathlib

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_nanguard import CheckpointGuard, last_good_checkpoint
from lightning_nanguard.checkpoints import LAST_GOOD_NAME
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer


class RankProbe(Callback):
    """Writes, per rank, the step training started at, whether the weights were finite, and a weight checksum."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checksum = float(sum(p.detach().double().sum() for p in pl_module.parameters()))
        record = {"step": trainer.global_step, "finite": all_finite(pl_module), "checksum": checksum}
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(record, f)


@pytest.mark.distributed
def test_ddp_fallback_is_identical_on_every_rank_and_nan_save_is_refused(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    mc = ModelCheckpoint(dirpath=str(ck), every_n_train_steps=2, save_top_k=-1)
    make_trainer(tmp_path / "first", callbacks=[mc, CheckpointGuard()], enable_checkpointing=True, max_steps=4).fit(
        TinyModel()
    )
    bad = ck / "epoch=0-step=4.ckpt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))

    ck2 = tmp_path / "ck2"
    callbacks = [
        ModelCheckpoint(dirpath=str(ck2), every_n_train_steps=1, save_top_k=1, monitor="step", mode="max"),
        CheckpointGuard(fallback=True),
        FaultInjector("param", steps=[4], value="nan"),
        RankProbe(str(tmp_path)),
    ]
    trainer = make_trainer(
        tmp_path / "ddp",
        callbacks=callbacks,
        enable_checkpointing=True,
        strategy="ddp_spawn",
        devices=2,
        max_steps=6,
    )
    trainer.fit(TinyModel(), ckpt_path=str(bad))

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # same fallback file, same weights, on both ranks
    assert ranks[0]["step"] == 2
    assert ranks[0]["finite"]
    with open(tmp_path / "ddp" / "nanguard" / "incidents.jsonl", encoding="utf-8") as f:
        incidents = [json.loads(line) for line in f]
    assert [(r["action"], r["step"]) for r in incidents] == [("fallback", 2), ("refuse", 5), ("refuse", 6)]
    good = last_good_checkpoint(str(ck2))
    assert good == str(ck2 / LAST_GOOD_NAME)
    assert torch.load(good, weights_only=True)["global_step"] == 4
