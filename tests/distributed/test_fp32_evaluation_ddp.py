"""FP32Evaluation under ddp_spawn (2 CPU processes, gloo) in true half precision, validating mid-fit.

Casting the real parameters for evaluation would silently disconnect DDP's gradient all-reduce hooks (the ranks'
parameters then drift apart after the first validation); the float32 copies must leave them intact.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_nanguard import FP32Evaluation
from tests.fp32_eval_models import HalfOverflowModel
from tests.helpers import make_trainer


class RankDump(Callback):
    """Writes each rank's parameters, evaluation calls and re-run count to ``out_dir/rank<r>.pt`` at the end of fit."""

    def __init__(self, out_dir: str, fp32_eval: FP32Evaluation) -> None:
        self.out_dir = out_dir
        self.fp32_eval = fp32_eval

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        state = {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "eval_calls": [(i, str(d)) for i, d, _ in pl_module.eval_calls],
            "reruns": self.fp32_eval.fp32_reruns,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
        }
        torch.save(state, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


@pytest.mark.distributed
@pytest.mark.parametrize(("precision", "mode"), [("16-true", "always"), ("bf16-true", "on_nonfinite")])
def test_params_stay_identical_across_ranks_after_fp32_validation(tmp_path: Any, precision: str, mode: str) -> None:
    # DistributedSampler gives rank r the samples r, r+2, ...: odd samples 1..15 make batch 0 bad on rank 1 only.
    model = HalfOverflowModel(bad_samples=range(1, 16, 2), sync_dist=True)
    fp32_eval = FP32Evaluation(mode)
    trainer = make_trainer(
        tmp_path,
        precision,
        strategy="ddp_spawn",
        devices=2,
        callbacks=[fp32_eval, RankDump(str(tmp_path), fp32_eval)],
        val_check_interval=2,
        limit_val_batches=2,
        max_steps=6,
    )
    trainer.fit(model)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name]), name  # gradients were all-reduced after every validation
    assert ranks[0]["params"]["head.weight"].dtype == (torch.float16 if precision == "16-true" else torch.bfloat16)
    for r in ranks:
        assert torch.isfinite(torch.tensor(r["val_loss"]))
    if mode == "always":
        assert all({d for _, d in r["eval_calls"]} >= {"torch.float32"} for r in ranks)
    else:
        # Three validations (steps 2, 4, 6), each re-running batch 0 on rank 1 alone (each rank decides for itself:
        # no collective per batch); the re-runs are gathered, so both ranks record the same three incidents.
        assert "torch.float32" not in {d for _, d in ranks[0]["eval_calls"]}
        assert "torch.float32" in {d for _, d in ranks[1]["eval_calls"]}
        assert ranks[0]["reruns"] == ranks[1]["reruns"] == 3
