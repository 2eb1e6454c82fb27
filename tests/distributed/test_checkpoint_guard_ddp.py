"""CheckpointGuard under DDP (2 CPU processes, gloo): every rank falls back to the same verified file; rank 0 writes
sidecars and refuses the non-finite checkpoint; a save refused on rank 0 only never makes the ranks disagree (no hang).

Run as a script (``python tests/distributed/test_checkpoint_guard_ddp.py --child OUT``) it is the child process of
the hang test, which the test kills after a hard timeout.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_nanguard import AutoRollback, CheckpointGuard, GradNormMonitor, last_good_checkpoint
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer

REPO = pathlib.Path(__file__).resolve().parents[2]
HANG_TIMEOUT_S = 180  # the fit takes ~15 s on 2 shared CPU cores; a deadlock never ends


class RankProbe(Callback):
    """Writes, per rank, the resumed step, finiteness and a weight checksum at train start, and at train end the
    final parameters and the incidents the rank recorded (spawned ranks cannot return them)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checksum = float(sum(p.detach().double().sum() for p in pl_module.parameters()))
        record = {"step": trainer.global_step, "finite": all_finite(pl_module), "checksum": checksum}
        with open(os.path.join(self.out_dir, f"start{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(record, f)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(params, os.path.join(self.out_dir, f"params{rank}.pt"))
        records = [r.to_dict() for r in get_engine(trainer).sink.records]
        with open(os.path.join(self.out_dir, f"incidents{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(records, f)


def _read(out: pathlib.Path, name: str) -> Any:
    return json.loads((out / name).read_text(encoding="utf-8"))


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
        RankProbe(str(tmp_path)),  # first: its on_train_end runs before the end-of-fit check raises
        ModelCheckpoint(dirpath=str(ck2), every_n_train_steps=1, save_top_k=1, monitor="step", mode="max"),
        CheckpointGuard(fallback=True),
        FaultInjector("param", steps=[4], value="nan"),
    ]
    trainer = make_trainer(
        tmp_path / "ddp",
        callbacks=callbacks,
        enable_checkpointing=True,
        strategy="ddp_spawn",
        devices=2,
        max_steps=6,
    )
    # Nothing here can restore the NaN weights: the saves are refused and the fit ends with the documented error.
    with pytest.raises(Exception, match="training ended with non-finite parameters"):
        trainer.fit(TinyModel(), ckpt_path=str(bad))  # the fallback warning is emitted in the spawned ranks

    starts = [_read(tmp_path, f"start{r}.json") for r in (0, 1)]
    assert starts[0] == starts[1]  # same fallback file, same weights, on both ranks
    assert starts[0]["step"] == 2
    assert starts[0]["finite"]
    seen = [[(i["action"], i["step"]) for i in _read(tmp_path, f"incidents{r}.json")] for r in (0, 1)]
    assert seen[0] == [("fallback", 2), ("refuse", 5), ("refuse", 6)]  # rank 0 saves, so rank 0 refuses
    assert seen[1] == [("fallback", 2)]  # every rank loads, so every rank falls back
    good = last_good_checkpoint(str(ck2))
    assert good is not None
    assert torch.load(good, weights_only=True)["global_step"] == 4
    assert torch.load(ck2 / LAST_GOOD_NAME, weights_only=True)["global_step"] == 4


class PoisonAfterStep(Callback):
    """After the optimizer step of step 9, on rank 0 only, one weight becomes NaN before ModelCheckpoint saves."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 10 and trainer.global_rank == 0:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


def _refused_save_child(out: str) -> None:
    """The fit of the hang test: a save refused on rank 0 only, AutoRollback's snapshots due on every rank."""
    torch.set_num_threads(1)
    callbacks = [
        PoisonAfterStep(),
        GradNormMonitor(),
        AutoRollback(every_n_steps=5, quiet_steps=2),
        CheckpointGuard(),
        RankProbe(out),
        ModelCheckpoint(dirpath=os.path.join(out, "ck"), every_n_train_steps=1, save_top_k=1),
    ]
    trainer = make_trainer(
        out, callbacks=callbacks, enable_checkpointing=True, strategy="ddp_spawn", devices=2, max_steps=20
    )
    trainer.fit(TinyModel())


@pytest.mark.distributed
def test_ddp_save_refused_on_rank_zero_only_does_not_hang_or_split_the_ranks(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("PL_DISABLE_FORK", "1")
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", str(tmp_path)],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the spawned ranks are killed with it
    )
    try:
        output, _ = child.communicate(timeout=HANG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail(f"DDP fit with a save refused on rank 0 only did not finish within {HANG_TIMEOUT_S} s (deadlock)")
    assert child.returncode == 0, output.decode(errors="replace")[-3000:]
    incidents = [_read(tmp_path, f"incidents{r}.json") for r in (0, 1)]
    # The save checks the state on every rank first (AutoRollback is installed): rank 0's NaN weight is rolled back
    # on both ranks before anything is written, so no save is refused, and nothing waits in a collective alone.
    assert not [i for recs in incidents for i in recs if i["action"] == "refuse"]
    # Every decision is the same on both ranks: one rollback, same step, same restored state.
    decided = [[(i["step"], i["actions"]) for i in recs if i["action"] != "refuse"] for recs in incidents]
    assert decided[0] == decided[1]
    assert [a for _, actions in decided[0] for a in actions].count("rollback") == 1
    p0, p1 = (torch.load(tmp_path / f"params{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert all(bool(torch.isfinite(v).all()) for v in p0.values())


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _refused_save_child(sys.argv[2])
