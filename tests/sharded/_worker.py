"""One 2-rank CPU training run for the sharded tests: ``python -m tests.sharded._worker CONFIG_JSON OUT_DIR``.

Lightning's ModelParallelStrategy (and "ddp") launch the other rank by re-running this command, so the run lives in
its own processes, never inside pytest. Each rank writes ``rank{r}.json`` (incidents, per-step readings, the full-
tensor reference norms) and rank 0 writes ``params.pt`` (every parameter as a full tensor, gathered at the end).

Config keys: ``strategy`` ("fsdp2" | "ddp"), ``max_steps``, ``fault`` (FaultInjector kwargs or null), ``monitor``
(GradNormMonitor kwargs or null), ``rollback`` (AutoRollback kwargs or null), ``backoff`` (OptimizerBackoff kwargs
or null), ``watchdog`` (bool: add a LossScaleWatchdog), ``drop_steps`` (updates dropped on every rank by the test
itself: the reference for a skip), ``optimizer`` ("adamw" | "adamw_fused" | "sgd"), ``precision`` (a Trainer precision; default "32-true").
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback, GradNormMonitor, LossScaleWatchdog, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from lightning_nanguard.engine.sharded_sensing import current_grad_norm
from lightning_nanguard.signals.gradients import layer_norms
from lightning_nanguard.testing import FaultInjector


def _full(t: Tensor) -> Tensor:
    """The whole tensor on every rank (a collective for a DTensor: every rank calls it, in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardedMLP(pl.LightningModule):
    """A small MLP; with ``shard=True`` every Linear and the root are ``fully_shard``-ed over the data-parallel mesh."""

    def __init__(self, shard: bool, optimizer: str = "adamw") -> None:
        super().__init__()
        self.shard = shard
        self.optimizer_name = optimizer
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in self.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.02, fused=self.optimizer_name == "adamw_fused")

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=g)
        y = torch.cat([x[:, :1] * 0.5 - x[:, 1:2], x[:, 2:3].tanh()], dim=1)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class ShardedFaultInjector(FaultInjector):
    """FaultInjector that poisons this rank's local shard of a DTensor (a DTensor slice would start a collective
    on the injecting rank alone and hang)."""

    def _poison(self, t: Tensor) -> None:
        from torch.distributed.tensor import DTensor

        super()._poison(t.to_local() if isinstance(t, DTensor) else t)


class DropSteps(pl.Callback):
    """The reference for a skip: drop the update of ``steps`` on every rank, as nanguard's skip does."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step in self.steps:
            optimizer.zero_grad(set_to_none=True)


def reference_norms(full: dict[str, Tensor]) -> dict[str, Any]:
    """The total, per-tensor and per-layer (GradNormMonitor's default ``layer_depth=1``) 2-norms of full gradients."""
    layers: dict[str, float] = {}
    for n, g in full.items():
        layer = n.split(".")[0]
        layers[layer] = layers.get(layer, 0.0) + float(g.square().sum())
    return {
        "grad_norm": math.sqrt(sum(float(g.square().sum()) for g in full.values())),
        "tensors": {n: float(g.norm()) for n, g in full.items()},
        "layers": {k: math.sqrt(v) for k, v in layers.items()},
    }


class Record(pl.Callback):
    """Per step: nanguard's reading, and the norms of the full (gathered) gradients as the unsharded reference."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps: list[dict[str, Any]] = []
        self._reference: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._reference = {}
        named = [(n, p.grad) for n, p in pl_module.named_parameters()]
        if any(g is None for _, g in named):
            return  # dropped by nanguard (on every rank alike)
        self._reference = reference_norms({n: _full(g).double() for n, g in named})
        index = get_engine(trainer).sensor.param_index(pl_module, optimizer, 0)
        self._reference["current_grad_norm"] = current_grad_norm(trainer, index)  # a collective: on every rank

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        reading = get_engine(trainer).last_reading
        row: dict[str, Any] = {"step": trainer.global_step - 1, "reference": self._reference}
        row["lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        if reading is not None:
            row.update(grad_norm=reading.grad_norm, loss=reading.loss, dropped=reading.dropped)
            if reading.norms is not None:
                names, values = layer_norms(reading.index, reading.norms)
                row["layers"] = dict(zip(names, values.tolist(), strict=True))
                row["tensors"] = dict(
                    zip(
                        [reading.index.names[i] for i in (reading.norms.present or range(reading.index.count))],
                        reading.norms.tensor_norms.tolist(),
                        strict=True,
                    )
                )
        self.steps.append(row)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        rank = trainer.global_rank
        full = {n: _full(p.detach()).clone() for n, p in pl_module.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(self.out_dir, "params.pt"))
        engine = get_engine(trainer)
        out = {
            "incidents": [r.to_dict() for r in engine.sink.records],
            "steps": self.steps,
            "skipped_steps": engine.skipped_steps,
            "world_size": trainer.world_size,
            "param_types": sorted({type(p).__name__ for p in pl_module.parameters()}),
        }
        with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, default=str)


def configured_callbacks(config: dict[str, Any]) -> list[pl.Callback]:
    """What a run's config asks for besides its fault and its recorder: the test's own update dropper and the
    nanguard callbacks, in this order."""
    callbacks: list[pl.Callback] = []
    if config.get("drop_steps"):
        callbacks.append(DropSteps(config["drop_steps"]))
    if config.get("monitor") is not None:
        callbacks.append(GradNormMonitor(**config["monitor"]))
    if config.get("rollback") is not None:
        callbacks.append(AutoRollback(**config["rollback"]))
    if config.get("backoff") is not None:
        callbacks.append(OptimizerBackoff(**config["backoff"]))
    if config.get("watchdog"):
        callbacks.append(LossScaleWatchdog())
    return callbacks


def two_rank_trainer(
    config: dict[str, Any], out_dir: str, strategy: Any, callbacks: list[pl.Callback], accelerator: str = "cpu"
) -> pl.Trainer:
    """The Trainer every 2-rank worker fits with: no logger, checkpoint, progress bar or validation; every step
    logged."""
    return pl.Trainer(
        default_root_dir=out_dir,
        accelerator=accelerator,
        devices=2,
        strategy=strategy,
        max_steps=int(config.get("max_steps", 6)),
        precision=config.get("precision", "32-true"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=1,
        callbacks=callbacks,
    )


def run_from_argv(main: Any) -> None:
    """``main(config, out_dir)`` for ``argv[1:]``: one run (``CONFIG OUT_DIR``), or several in one launch
    (``[[config, out_dir], ...]``: the ranks' process group is started once), then the process group is destroyed."""
    spec = json.loads(sys.argv[1])
    for config, out_dir in spec if isinstance(spec, list) else [(spec, sys.argv[2])]:
        main(config, out_dir)
    # Lightning leaves the process group up; its threads torn down with the interpreter can abort the process
    # ("terminate called without an active exception", exit -6) after a run that succeeded.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Even then, torch's threads torn down with the interpreter have aborted a rank once in a while (seen under
    # FSDP2 after a passing run): the results are written, so the process ends here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(config: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(1234, verbose=False)
    callbacks: list[pl.Callback] = []
    if config.get("fault"):
        callbacks.append(ShardedFaultInjector(**config["fault"]))
    callbacks += [*configured_callbacks(config), Record(out_dir)]
    fsdp2 = config.get("strategy", "fsdp2") == "fsdp2"
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp2 else "ddp"
    trainer = two_rank_trainer(config, out_dir, strategy, callbacks)
    trainer.fit(ShardedMLP(shard=fsdp2, optimizer=config.get("optimizer", "adamw")))


if __name__ == "__main__":
    run_from_argv(main)
