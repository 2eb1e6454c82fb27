"""Regressions, group B: every decision and every collective is rank-consistent; nothing hangs.

One test per script of ``../shared/repros/`` (group B of issue 12): ddp_spawn with 2 CPU processes (gloo). Each fit
runs with a short collective timeout, so a deadlock fails the test in seconds instead of hanging the suite.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import (
    AutoRollback,
    CheckpointGuard,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    OptimizerBackoff,
)
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


def ddp_spawn(seconds: int = 30) -> DDPStrategy:
    """``strategy="ddp_spawn"`` with a collective timeout: a rank left alone in a collective raises, never hangs."""
    return DDPStrategy(start_method="spawn", timeout=timedelta(seconds=seconds))


class RankDump(pl.Callback):
    """Writes each rank's parameters, learning rate at each step's start, loss scale and incidents to ``out_dir`` at the end of fit."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        state = {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "scale": None if scaler is None else float(scaler.get_scale()),
            "global_step": trainer.global_step,
        }
        torch.save(state, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))
        records = [r.to_dict() for r in get_engine(trainer).sink.records]
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump({"lrs": self.lrs, "incidents": records}, f)


def load_ranks(out: pathlib.Path) -> list[dict[str, Any]]:
    ranks = []
    for r in (0, 1):
        state = torch.load(out / f"rank{r}.pt", weights_only=True)
        state.update(json.loads((out / f"rank{r}.json").read_text()))
        ranks.append(state)
    return ranks


def assert_identical_finite_params(ranks: list[dict[str, Any]]) -> None:
    p0, p1 = ranks[0]["params"], ranks[1]["params"]
    for name in p0:
        assert torch.equal(p0[name], p1[name]), f"{name} differs across ranks"
        assert bool(torch.isfinite(p0[name]).all()), name


def engine_decided(incidents: list[dict[str, Any]]) -> list[tuple[int, str, list[str]]]:
    """Incidents of training steps (every rank records them); checkpoint refusals are rank 0's own (it saves)."""
    return [(i["step"], i["action"], i["actions"]) for i in incidents if i["trigger"] != "nonfinite_checkpoint"]


class PoisonAfterStep(pl.Callback):
    """After the optimizer step ``step``, on ``rank`` only, one weight becomes NaN (before ModelCheckpoint saves)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step - 1 == self.step and trainer.global_rank == self.rank:
            head = pl_module.head
            assert isinstance(head, torch.nn.Linear)
            with torch.no_grad():
                head.weight.view(-1)[0] = float("nan")


# repro: ddp_refused_save_hang.py
@pytest.mark.distributed
def test_save_refused_on_rank_zero_only_does_not_hang(tmp_path: pathlib.Path) -> None:
    # Rank 0 (the only rank that saves) gets its save refused: a rank-local incident. AutoRollback's quiet-steps
    # state must not take it, or rank 0 skips a snapshot whose finiteness all-reduce rank 1 enters alone.
    callbacks = [
        PoisonAfterStep(step=9, rank=0),
        GradNormMonitor(),
        AutoRollback(every_n_steps=5, quiet_steps=2),
        CheckpointGuard(),
        ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=1),
        RankDump(str(tmp_path)),
    ]
    trainer = make_trainer(
        tmp_path, strategy=ddp_spawn(), devices=2, callbacks=callbacks, enable_checkpointing=True, max_steps=16
    )
    trainer.fit(TinyModel())
    ranks = load_ranks(tmp_path)
    assert_identical_finite_params(ranks)
    decided = [engine_decided(r["incidents"]) for r in ranks]
    assert decided[0] == decided[1]
    assert [(step, action) for step, action, _ in decided[0]] == [(10, "rollback")]
    # The save checked the state on every rank first and rolled it back, so nothing was refused or written NaN.
    assert not [i for r in ranks for i in r["incidents"] if i["action"] == "refuse"]


class WithRankLocalStat(TinyModel):
    """TinyModel whose checkpoints carry a rank-local statistic that is not model state (not a parameter or buffer,
    so no step check sees it): it is inf on rank 0 from step ``bad_at`` until step ``heal_at``, so rank 0's saves in
    between are refused, on rank 0 only."""

    def __init__(self, bad_at: int, heal_at: int) -> None:
        super().__init__()
        self.bad_at, self.heal_at = bad_at, heal_at

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        step, rank = self.trainer.global_step, self.trainer.global_rank
        bad = rank == 0 and self.bad_at < step <= self.heal_at
        checkpoint["state_dict"]["loss_stat"] = torch.tensor([math.inf if bad else 0.0])


# repro: ddp_refused_save_desyncs_lr_recovery.py
@pytest.mark.distributed
def test_rank_zero_only_refusals_do_not_desync_lr_recovery(tmp_path: pathlib.Path) -> None:
    # Backoff at step 3 on both ranks; recover_after=4. Rank 0's saves of steps 5..8 are refused (its own statistic
    # overflowed): those rank-local incidents must not restart rank 0's recovery timer.
    callbacks = [
        RankDump(str(tmp_path)),
        FaultInjector("grad", steps=[3], value=1e6),  # a gradient spike: a lower LR answers it
        GradNormMonitor(spike_zscore=40.0, spike_warmup=1, on_spike="skip"),
        OptimizerBackoff(triggers="skip", skips_before_backoff=1, recover_after=4),
        CheckpointGuard(),
        ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, save_top_k=1),
    ]
    trainer = make_trainer(
        tmp_path, strategy=ddp_spawn(), devices=2, callbacks=callbacks, enable_checkpointing=True, max_steps=14
    )
    trainer.fit(WithRankLocalStat(bad_at=4, heal_at=8))
    ranks = load_ranks(tmp_path)
    assert ranks[0]["lrs"] == ranks[1]["lrs"], ranks[0]["lrs"]
    lrs = {int(k): v for k, v in ranks[0]["lrs"].items()}
    assert lrs[3] == pytest.approx(0.05), lrs
    assert lrs[4] == pytest.approx(0.025), lrs  # backed off after step 3
    assert lrs[8] == pytest.approx(0.05), lrs  # recovered after steps 4..7 without an engine incident ...
    assert lrs[13] == pytest.approx(0.05), lrs  # and recovered, on both ranks alike
    refused = sorted(i["step"] for i in ranks[0]["incidents"] if i["action"] == "refuse")
    assert refused[:1] == [5]  # the rank-local refusals did happen
    assert_identical_finite_params(ranks)
    decided = [engine_decided(r["incidents"]) for r in ranks]
    assert decided[0] == decided[1]


# repro: fp16_ddp_one_rank_overflow_diverges.py
@pytest.mark.distributed
@pytest.mark.parametrize(("precision", "scale"), [("32-true", None), ("16-mixed", 512.0)])
def test_nan_gradient_on_one_rank_keeps_ranks_identical(
    tmp_path: pathlib.Path, precision: str, scale: float | None
) -> None:
    # Under 16-mixed both ranks' GradScalers must skip and halve together (1024 -> 512), or DDP's all-reduced
    # *scaled* gradients are unscaled by different scales from then on and the weights diverge.
    callbacks = [
        FaultInjector("grad", steps=[3], ranks=[1]),
        GradNormMonitor(),
        LossScaleWatchdog(),
        RankDump(str(tmp_path)),
    ]
    trainer = make_trainer(tmp_path, precision, strategy=ddp_spawn(), devices=2, callbacks=callbacks, max_steps=8)
    trainer.fit(TinyModel())
    ranks = load_ranks(tmp_path)
    assert ranks[0]["scale"] == ranks[1]["scale"] == scale
    assert_identical_finite_params(ranks)
    decided = [engine_decided(r["incidents"]) for r in ranks]
    assert decided[0] == decided[1]
    assert [step for step, _, _ in decided[0]] == [3]


class UnevenValidation(TinyModel):
    """Exact-once evaluation without DistributedSampler padding: rank 0 gets 3 validation batches, rank 1 gets 2."""

    def val_dataloader(self) -> DataLoader[Any]:
        n = 3 if self.trainer.global_rank == 0 else 2
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8 * n, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


# repro: fp32eval_on_nonfinite_uneven_ddp_eval_hangs.py
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode",
    ["always", "on_nonfinite"],
)
def test_fp32_evaluation_with_uneven_ddp_validation_finishes(
    tmp_path: pathlib.Path, mode: Literal["always", "on_nonfinite"]
) -> None:
    callbacks = [FP32Evaluation(mode), RankDump(str(tmp_path))]
    trainer = make_trainer(
        tmp_path,
        "bf16-mixed",
        strategy=ddp_spawn(seconds=20),
        devices=2,
        callbacks=callbacks,
        use_distributed_sampler=False,
        limit_val_batches=None,
        val_check_interval=4,
        max_steps=8,
    )
    trainer.fit(UnevenValidation())
    ranks = load_ranks(tmp_path)
    assert [r["global_step"] for r in ranks] == [8, 8]
    assert_identical_finite_params(ranks)


# fault matrix finding "one-rank-desync-unseen": a finite change on one rank's parameter
@pytest.mark.distributed
def test_a_finite_change_on_one_ranks_parameter_is_rolled_back_on_both_ranks(tmp_path: pathlib.Path) -> None:
    # x1e4 on element 0 of rank 0's first parameter at the start of step 3: finite, so no step check fires, and DDP
    # never re-broadcasts parameters. The snapshot at step 4 compares the ranks' copies first (2-norm and 1-norm per
    # tensor, one MAX all-reduce): they differ, so both ranks roll back to step 2's agreed snapshot.
    callbacks = [
        FaultInjector("param", steps=[3], ranks=[0], value=1e4),
        GradNormMonitor(),
        AutoRollback(every_n_steps=2, quiet_steps=0),
        RankDump(str(tmp_path)),
    ]
    trainer = make_trainer(tmp_path, strategy=ddp_spawn(), devices=2, callbacks=callbacks, max_steps=8)
    trainer.fit(TinyModel())
    ranks = load_ranks(tmp_path)
    assert_identical_finite_params(ranks)
    decided = [engine_decided(r["incidents"]) for r in ranks]
    assert decided[0] == decided[1] == [(4, "rollback", ["rollback"])], decided
    (incident,) = ranks[0]["incidents"]
    assert incident["trigger"] == "rank_divergence"
    assert incident["cause"] == "corrupt_state"
    assert incident["values"]["restored_from_step"] == 2
    assert "differ" in incident["where"]


@pytest.mark.distributed
def test_ranks_that_differ_at_the_end_with_nothing_to_restore_raise_rank_divergence_error(
    tmp_path: pathlib.Path,
) -> None:
    callbacks = [FaultInjector("param", steps=[3], ranks=[1], value=1e4), GradNormMonitor()]
    trainer = make_trainer(tmp_path, strategy=ddp_spawn(), devices=2, callbacks=callbacks, max_steps=6)
    with pytest.raises(Exception, match=r"RankDivergenceError|ranks' copies of"):
        trainer.fit(TinyModel())
