"""One 2-rank training run under FSDPStrategy (FSDP1): ``python -m tests.sharded._fsdp1_worker CONFIG_JSON OUT_DIR``.

Lightning refuses FSDPStrategy on CPU in two places: its accelerator connector (only for the class itself and its
registered names: ``type(flag) is FSDPStrategy``) and ``_setup_model``, which passes ``device_id=root_device.index``
(``None`` on CPU), whereupon torch's FSDP1 raises "FSDP needs a non-CPU accelerator device". ``CPUFSDPStrategy``
below (test-only) wraps the model itself with ``device_id=torch.device("cpu")`` and otherwise is Lightning's
FSDPStrategy: the same setup, optimizer handling, hooks and checkpoints; FSDP1 itself runs on gloo CPU ranks. With
``accelerator="gpu"`` the real FSDPStrategy runs (the ``gpu`` tests).

Each rank writes ``rank{r}.json`` (incidents, per-step readings with the norms of the full gradients gathered by
``FSDP.summon_full_params(with_grads=True)`` as the reference); rank 0 writes ``params.pt`` (full parameters).

Config keys as ``tests.sharded._worker`` (``max_steps``, ``monitor``, ``rollback``, ``backoff``, ``watchdog``,
``drop_steps``, ``optimizer``, ``precision``), plus ``faults`` (a list of FaultInjector kwargs), ``accelerator``
("cpu" | "gpu") and ``use_orig_params`` (default True).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from lightning_nanguard.engine import get_engine
from lightning_nanguard.signals.gradients import layer_norms
from lightning_nanguard.testing import FaultInjector
from tests.sharded._worker import ShardedMLP, configured_callbacks, reference_norms, run_from_argv, two_rank_trainer


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy, with the model wrapped on the CPU (``device_id=torch.device("cpu")``): the only
    change needed for FSDP1 to run on gloo CPU ranks (module docstring). Test-only."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            self.kwargs.pop("auto_wrap_policy", None)  # applied above; Lightning warns about it on a wrapped model
        return super()._setup_model(model)


def _fsdp(trainer: pl.Trainer) -> Any:
    return trainer.strategy.model


class Record(pl.Callback):
    """Per step: nanguard's reading, and the norms of the full gradients (gathered by FSDP itself) as reference."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps: list[dict[str, Any]] = []
        self._reference: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from lightning_nanguard.signals.sharded import original_name

        self._reference = {}
        if all(p.grad is None for p in pl_module.parameters()):  # dropped by nanguard (on every rank alike)
            return
        # A collective (every rank calls it): the full parameters and gradients, in their original shapes.
        with FSDP.summon_full_params(_fsdp(trainer), with_grads=True, writeback=False):
            full = {original_name(n): p.grad.double().clone() for n, p in pl_module.named_parameters()}
        self._reference = reference_norms(full)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        reading = get_engine(trainer).last_reading
        row: dict[str, Any] = {"step": trainer.global_step - 1, "reference": self._reference}
        row["lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        if reading is not None:
            row.update(grad_norm=reading.grad_norm, loss=reading.loss, dropped=reading.dropped)
            if reading.norms is not None:
                names, values = layer_norms(reading.index, reading.norms)
                row["layers"] = dict(zip(names, values.tolist(), strict=True))
                present = reading.norms.present or range(reading.index.count)
                row["tensors"] = dict(
                    zip([reading.index.names[i] for i in present], reading.norms.tensor_norms.tolist(), strict=True)
                )
        self.steps.append(row)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from lightning_nanguard.signals.sharded import original_name

        rank = trainer.global_rank
        with FSDP.summon_full_params(_fsdp(trainer), writeback=False):  # a collective: every rank
            full = {original_name(n): p.detach().clone().cpu() for n, p in pl_module.named_parameters()}
        if rank == 0:
            torch.save(full, os.path.join(self.out_dir, "params.pt"))
        engine = get_engine(trainer)
        out = {
            "incidents": [r.to_dict() for r in engine.sink.records],
            "steps": self.steps,
            "skipped_steps": engine.skipped_steps,
            "world_size": trainer.world_size,
            "local_numels": {n: p.numel() for n, p in pl_module.named_parameters()},
        }
        with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, default=str)


def main(config: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(1234, verbose=False)
    callbacks: list[pl.Callback] = [FaultInjector(**fault) for fault in config.get("faults", [])]
    callbacks += [*configured_callbacks(config), Record(out_dir)]
    gpu = config.get("accelerator", "cpu") == "gpu"
    strategy_cls = FSDPStrategy if gpu else CPUFSDPStrategy
    strategy = strategy_cls(auto_wrap_policy={nn.Linear}, use_orig_params=bool(config.get("use_orig_params", True)))
    trainer = two_rank_trainer(config, out_dir, strategy, callbacks, accelerator="gpu" if gpu else "cpu")
    trainer.fit(ShardedMLP(shard=False, optimizer=config.get("optimizer", "adamw")))


if __name__ == "__main__":
    run_from_argv(main)
