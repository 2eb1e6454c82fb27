"""One 2-rank CPU run of FP32Evaluation under ModelParallelStrategy + FSDP2:
``python -m tests.sharded._eval_worker CONFIG_JSON OUT_DIR``.

Config keys: ``precision`` (default "bf16-mixed"), ``fp32_eval`` (FP32Evaluation kwargs, or null for none).
Two training steps, then one validation epoch of 2 batches per rank. Each rank writes ``rank{r}.json``: the dtypes of
its validation outputs, the (rank-synced) validation loss, and the error ``fit`` raised, if any.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import FP32Evaluation
from tests.sharded._worker import ShardedMLP


class EvalMLP(ShardedMLP):
    def __init__(self) -> None:
        super().__init__(shard=True)
        self.val_dtypes: list[str] = []

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        self.val_dtypes.append(str(out.dtype).replace("torch.", ""))
        loss = nn.functional.mse_loss(out.float(), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def val_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :2].clone()), batch_size=8)


def main(config: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(1234, verbose=False)
    callbacks: list[pl.Callback] = []
    if config.get("fp32_eval") is not None:
        callbacks.append(FP32Evaluation(**config["fp32_eval"]))
    trainer = pl.Trainer(
        default_root_dir=out_dir,
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        precision=config.get("precision", "bf16-mixed"),
        max_steps=2,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = EvalMLP()
    error: dict[str, str] = {}
    try:
        trainer.fit(model)
    except Exception as err:  # recorded, not re-raised: the test compares what both ranks saw
        error = {"type": type(err).__name__, "message": str(err)}
    val_loss = trainer.callback_metrics.get("val_loss")
    out = {
        "val_dtypes": model.val_dtypes,
        "val_loss": None if val_loss is None else float(val_loss),
        "error": error,
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
    # Lightning leaves the process group up; its threads torn down with the interpreter can abort the process
    # ("terminate called without an active exception", exit -6) after a run that succeeded.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Even then, torch's threads torn down with the interpreter have aborted a rank once in a while (seen under
    # FSDP2 after a passing run): the results are written, so the process ends here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
