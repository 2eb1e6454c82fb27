"""One 2-rank CPU run of AutoRollback's probe under FSDP2: ``python -m tests.sharded._probe_worker CONFIG OUT_DIR``.

The model is ``_worker.ShardedMLP`` with a BatchNorm (a buffer every training forward writes, and parameters in the
root's FSDP2 group, which FSDP2 keeps all-gathered after a forward) and noise drawn from the torch RNG in
``training_step`` (a stream the probe's seeded forward must put back): a scoring that leaked into the training state
would change the trained parameters. Each rank writes ``rank{r}.json`` (incidents, the probe's scores, verdict and
samples, what every ``training_step`` call saw, and which modules held plain, unsharded parameters after the batch's
start and end) and rank 0 writes ``params.pt`` (every parameter as a full tensor, and every buffer).

Config keys: ``max_steps``, ``optimizer`` ("sgd" | "adamw"), ``fault`` (FaultInjector kwargs or null), ``monitor``
(GradNormMonitor kwargs), ``rollback`` (AutoRollback kwargs), ``backoff`` (OptimizerBackoff kwargs or null),
``precision`` (default "32-true"), ``lr_jump`` (``[step, factor]``: the learning rate multiplied by ``factor`` from
that step on, or null), ``fail_scoring`` (a step: its scorings raise midway through the forward, on both ranks, or
null), ``poison`` (a step: from that step on, the first of rank 1's probe samples is NaN wherever
it comes back, so that the quarantine takes it: rank 1's probe alone then holds a quarantined sample; or null).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from lightning_nanguard import AutoRollback, GradNormMonitor, OptimizerBackoff
from lightning_nanguard.engine import get_engine
from tests.sharded._worker import ShardedFaultInjector, ShardedMLP, _full, run_from_argv, two_rank_trainer

# What each call of training_step saw (a module global: a scoring puts the module's own attributes back).
CALLS: list[dict[str, Any]] = []


class ProbedMLP(ShardedMLP):
    """``ShardedMLP`` with a BatchNorm after the first layer and input noise from the torch RNG."""

    def __init__(self, optimizer: str, lr_jump: list[float] | None, fail_scoring: int | None) -> None:
        super().__init__(shard=True, optimizer=optimizer)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.lr_jump = lr_jump
        self.fail_scoring = fail_scoring

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        if not torch.is_grad_enabled() and self.trainer.global_step == self.fail_scoring:
            raise RuntimeError("a scoring that fails midway through the forward")  # the root's forward is unfinished
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x + 0.01 * torch.randn_like(x))
        CALLS.append(
            {"grad": torch.is_grad_enabled(), "autocast": torch.is_autocast_enabled("cpu"), "dtype": str(out.dtype)}
        )
        return nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=0.02)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.lr_jump is None:
            return opt
        at, factor = int(self.lr_jump[0]), float(self.lr_jump[1])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor if s >= at else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def unsharded(module: nn.Module) -> list[str]:
    """The modules whose own parameters are registered as plain tensors (all-gathered) rather than DTensor shards."""
    from torch.distributed.tensor import DTensor

    found = []
    for name, m in module.named_modules():
        own = list(m.parameters(recurse=False))
        if own and not all(isinstance(p, DTensor) for p in own):
            found.append(name or "<root>")
    return found


class Watch(pl.Callback):
    """Per batch (after nanguard's hooks): the probe's scorings and samples, the training_step calls, and the modules
    left unsharded after the batch's start (a snapshot's scoring) and its end (a spike's)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: list[dict[str, Any]] = []
        self._start: dict[str, Any] = {}
        self._calls = 0  # CALLS seen up to the last batch end

    @staticmethod
    def rollback(trainer: pl.Trainer) -> AutoRollback:
        return next(c for c in trainer.callbacks if isinstance(c, AutoRollback))  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = {"unsharded_at_start": unsharded(pl_module)}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        probe = self.rollback(trainer).probe
        self.rows.append(
            {
                "step": trainer.global_step - 1,
                "calls": CALLS[self._calls :],  # a snapshot's scoring, the training step, a spike's scoring
                "scorings": probe.scorings,
                "samples": sorted(probe.batch.samples),
                "unsharded_at_start": self._start["unsharded_at_start"],
                "unsharded_at_end": unsharded(pl_module),
                "lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
            }
        )
        self._calls = len(CALLS)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        rank = trainer.global_rank
        state = {n: _full(p.detach()).clone() for n, p in pl_module.named_parameters()}
        state.update({f"buffer:{n}": b.detach().clone() for n, b in pl_module.named_buffers()})
        if rank == 0:
            torch.save(state, os.path.join(self.out_dir, "params.pt"))
        probe = self.rollback(trainer).probe
        verdict = probe.verdict
        out = {
            "incidents": [r.to_dict() for r in get_engine(trainer).sink.records],
            "rows": self.rows,
            "scores": {str(k): v for k, v in probe.book.scores.items()},
            "verdict": None if verdict is None else {"step": verdict.step, "rose": verdict.rose, **verdict.values()},
            "scorings": probe.scorings,
        }
        with open(os.path.join(self.out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, default=str)


class PoisonRank1Probe(pl.Callback):
    """From step ``start`` on, the first of rank 1's probe samples (learned from every rank at the end of step 0:
    an all-gather on every rank) is NaN wherever it comes back (once an epoch, in some rank's batch)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.sample: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == 1 and self.sample is None:
            mine = sorted(Watch.rollback(trainer).probe.batch.samples)
            every: list[Any] = [None, None]
            torch.distributed.all_gather_object(every, mine)
            self.sample = int(every[1][0])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.sample is None or trainer.global_step < self.start:
            return
        quarantine = get_engine(trainer).registry.quarantine
        assert quarantine is not None
        for ids in quarantine.current.values():
            if ids is not None and self.sample in ids:
                batch[0][ids.index(self.sample)] = float("nan")


def main(config: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(1234, verbose=False)
    CALLS.clear()
    callbacks: list[pl.Callback] = []
    if config.get("fault"):
        callbacks.append(ShardedFaultInjector(**config["fault"]))
    callbacks += [GradNormMonitor(**config["monitor"]), AutoRollback(**config["rollback"])]
    if config.get("backoff") is not None:
        callbacks.append(OptimizerBackoff(**config["backoff"]))
    callbacks.append(Watch(out_dir))
    if config.get("poison") is not None:
        callbacks.append(PoisonRank1Probe(int(config["poison"])))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = two_rank_trainer(config, out_dir, strategy, callbacks)
    trainer.fit(ProbedMLP(config.get("optimizer", "sgd"), config.get("lr_jump"), config.get("fail_scoring")))


if __name__ == "__main__":
    run_from_argv(main)
