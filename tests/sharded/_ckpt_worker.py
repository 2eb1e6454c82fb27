"""One 2-rank CPU run with CheckpointGuard under ModelParallelStrategy + FSDP2 (or FSDPStrategy, FSDP1):
``python -m tests.sharded._ckpt_worker CONFIG_JSON OUT_DIR``.

Config keys: ``strategy`` ("fsdp2", default, or "fsdp1": ``tests.sharded._fsdp1_worker.CPUFSDPStrategy``, one FSDP1
unit per Linear, ``state_dict_type="sharded"`` if ``distributed`` else ``"full"``), ``accelerator`` ("cpu", default,
or "gpu": Lightning's own FSDPStrategy), ``ckpt_dir`` (ModelCheckpoint's dirpath, one checkpoint every ``every_n_steps``, all kept),
``max_steps``, ``ckpt_path`` (resume from it, or null), ``fallback`` (CheckpointGuard's), ``distributed``
(``save_distributed_checkpoint``; default true), ``poison`` (``[step, rank]``: a NaN written into that rank's local
shard of ``body.0.weight`` after that step's update, just before ModelCheckpoint saves; or null).

Each rank writes ``rank{r}.json``: the step training started at, the incidents, the error ``fit`` raised (type and
message; the run is not re-raised so that both ranks report), and the checkpoint events CheckpointGuard saw. Rank 0
writes ``params_start.pt`` (the full parameters at train start, after any resume) and ``params_step{N}.pt`` (the full
parameters as each checkpoint was built).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_nanguard import CheckpointGuard
from lightning_nanguard.engine import get_engine
from lightning_nanguard.signals.sharded import local_tensor
from tests.sharded._worker import ShardedMLP, _full


def _save_params(pl_module: pl.LightningModule, path: str, rank: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_nanguard.signals.sharded import original_name

    model = pl_module.trainer.strategy.model
    if isinstance(model, FSDP):  # FSDP1: its own gather of the full parameters (a collective: every rank)
        with FSDP.summon_full_params(model, writeback=False):
            full = {original_name(n): p.detach().clone() for n, p in pl_module.named_parameters()}
    else:
        full = {n: _full(p.detach()).clone() for n, p in pl_module.named_parameters()}  # a collective: every rank
    if rank == 0:
        torch.save(full, path)


class Record(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.start_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.start_step = trainer.global_step
        _save_params(pl_module, os.path.join(self.out_dir, "params_start.pt"), trainer.global_rank)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        path = os.path.join(self.out_dir, f"params_step{trainer.global_step}.pt")
        _save_params(pl_module, path, trainer.global_rank)


class PoisonBeforeSave(pl.Callback):
    """A NaN in one rank's local shard only, after the update of ``step`` and before the checkpoint of that step is
    built (ModelCheckpoint runs after the other callbacks): the other rank's local state is finite."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            weight = local_tensor(pl_module.body[0].weight)  # FSDP1: the parameter is this rank's piece already
            with torch.no_grad():
                weight.view(-1)[0] = float("nan")  # the local shard: no collective


def main(config: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(1234, verbose=False)
    record = Record(out_dir)
    guard = CheckpointGuard(fallback=bool(config.get("fallback", False)))
    checkpointing = ModelCheckpoint(
        dirpath=config["ckpt_dir"], every_n_train_steps=int(config.get("every_n_steps", 2)), save_top_k=-1
    )
    callbacks: list[pl.Callback] = [checkpointing, guard, record]
    if config.get("poison"):
        callbacks.insert(0, PoisonBeforeSave(*config["poison"]))
    strategy: Any
    fsdp1 = config.get("strategy", "fsdp2") == "fsdp1"
    if fsdp1:
        from lightning.pytorch.strategies import FSDPStrategy
        from torch import nn

        from tests.sharded._fsdp1_worker import CPUFSDPStrategy

        sharded = "sharded" if config.get("distributed", True) else "full"
        strategy_cls = FSDPStrategy if config.get("accelerator") == "gpu" else CPUFSDPStrategy
        strategy = strategy_cls(auto_wrap_policy={nn.Linear}, state_dict_type=sharded)
    else:
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=config.get("distributed", True)
        )
    trainer = pl.Trainer(
        default_root_dir=out_dir,
        accelerator=config.get("accelerator", "cpu"),
        devices=2,
        strategy=strategy,
        max_steps=int(config.get("max_steps", 4)),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    error: dict[str, str] = {}
    try:
        trainer.fit(ShardedMLP(shard=not fsdp1), ckpt_path=config.get("ckpt_path"))
    except Exception as err:  # recorded, not re-raised: the test compares what both ranks saw
        error = {"type": type(err).__name__, "message": str(err)}
    out = {
        "start_step": record.start_step,
        "global_step": trainer.global_step,
        "error": error,
        "incidents": [r.to_dict() for r in get_engine(trainer).sink.records],
        "refused_saves": guard.refused_saves,
        "last_saved": guard.last_saved,
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, default=str)


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
