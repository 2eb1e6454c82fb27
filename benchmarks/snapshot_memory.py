"""What AutoRollback adds to each DDP rank's resident memory, and what a snapshot and a restore cost on the CPU.

    PYTHONPATH=$PWD python benchmarks/snapshot_memory.py [--configs plain sharded full] [--ranks 4]
    PYTHONPATH=/work/main python benchmarks/snapshot_memory.py --configs plain old   (the code before sharding)

Each config is one Lightning fit on ``--ranks`` CPU processes (ddp_spawn, gloo) of a 6.3M-parameter MLP with AdamW,
12 steps, two snapshots kept (every 2 steps), rank 2's weights damaged at step 7 (a rollback on every rank). Per rank:
the resident set size (``VmRSS``) at train start and at train end, the ring's own byte count, and the time of each
``take`` and ``restore`` (process CPU time would hide the all-gather's waits: wall time, on a machine shared by the
ranks). AutoRollback's addition to resident memory is a config's growth from train start to train end minus the
plain fit's growth (the optimizer state and gradients every fit creates), up to the start of batch 6 (after three
snapshots, before the damage and the incident path's own allocations). Configs: ``plain`` (no AutoRollback),
``sharded`` (the default: 1/world of the parameters and optimizer state per rank), ``full`` (``shard=False``: a whole
copy per rank), ``old`` (the code before sharding, run from an older checkout: ``AutoRollback()`` as it was).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import AutoRollback
from lightning_nanguard.testing import FaultInjector


def rss() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class WideMLP(pl.LightningModule):
    def __init__(self, ranks: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 1))
        self.ranks = ranks

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.ranks * 12 * 2, 1024, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=2)


class Before(pl.Callback):
    """First in the list: the resident set at train start, and at the start of batch 6 (three snapshots taken, before
    the damage at step 7 and the incident path it starts, whose forensic replay allocates memory of its own)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rss_start = rss()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == 6:
            self.rss_step6 = rss()


class After(pl.Callback):
    """After AutoRollback: times its ring's take and restore; writes this rank's figures at train end."""

    def __init__(self, out: str, config: str, before: Before, rollback: AutoRollback | None) -> None:
        self.out, self.config, self.before, self.rollback = out, config, before, rollback
        self.times: dict[str, list[float]] = {"take_ms": [], "restore_ms": []}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rss_after_start_hooks = rss()
        if self.rollback is None:
            return
        ring = self.rollback.ring
        for name, key in (("take", "take_ms"), ("restore", "restore_ms")):
            original = getattr(ring, name)

            def timed(*args: Any, _original: Any = original, _key: str = key, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                result = _original(*args, **kwargs)
                self.times[_key].append((time.perf_counter() - t0) * 1e3)
                return result

            setattr(ring, name, timed)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        replica = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        for opt in trainer.optimizers:
            replica += sum(
                v.numel() * v.element_size()
                for s in opt.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            )
        ring = self.rollback.ring if self.rollback is not None else None
        info = {
            "config": self.config,
            "rank": trainer.global_rank,
            "replica_bytes": replica,
            "ring_bytes": sum(s.nbytes() for s in ring.slots) if ring is not None else 0,
            "rss_start": self.before.rss_start,
            "rss_after_train_start": self.rss_after_start_hooks,
            "rss_step6": self.before.rss_step6,
            "rss_end": rss(),
            **self.times,
        }
        with open(os.path.join(self.out, f"{self.config}-{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(info, f)


def run(config: str, ranks: int, out: str) -> list[dict[str, Any]]:
    before = Before()
    rollback = None if config == "plain" else AutoRollback(every_n_steps=2, quiet_steps=0)
    if rollback is not None and config == "full":
        rollback.ring.shard = False
    callbacks: list[pl.Callback] = [before]
    if rollback is not None:
        callbacks += [FaultInjector("param", steps=[7], ranks=[2 % ranks]), rollback]
    callbacks.append(After(out, config, before, rollback))
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=ranks,
            strategy="ddp_spawn",
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=callbacks,
        )
        trainer.fit(WideMLP(ranks))
    rows = []
    for r in range(ranks):
        with open(os.path.join(out, f"{config}-{r}.json"), encoding="utf-8") as f:
            rows.append(json.load(f))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", default=["plain", "sharded", "full"])
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as out:
        for config in args.configs:
            results[config] = run(config, args.ranks, out)
    plain = results.get("plain")
    growth_plain = statistics.median(r["rss_step6"] - r["rss_start"] for r in plain) if plain else 0
    print(f"{args.ranks} ranks; per rank, medians over ranks (MB = 2**20 bytes)", file=sys.stderr)
    print(
        "| config | replica MB | ring MB | ring / replica | allocated at train start MB | RSS growth to step 6 MB | "
        "added vs plain MB | added / replica | RSS growth to the end MB | take ms | restore ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mb = 2**20
    for config, rows in results.items():
        replica = statistics.median(r["replica_bytes"] for r in rows)
        ring = statistics.median(r["ring_bytes"] for r in rows)
        at_start = statistics.median(r["rss_after_train_start"] - r["rss_start"] for r in rows)
        growth = statistics.median(r["rss_step6"] - r["rss_start"] for r in rows)
        to_end = statistics.median(r["rss_end"] - r["rss_start"] for r in rows)
        added = growth - growth_plain if plain else float("nan")
        takes = [t for r in rows for t in r["take_ms"]]
        restores = [t for r in rows for t in r["restore_ms"]]
        print(
            f"| {config} | {replica / mb:.1f} | {ring / mb:.1f} | {ring / replica:.3f} | {at_start / mb:.1f} | "
            f"{growth / mb:.1f} | {added / mb:.1f} | {added / replica:.2f} | {to_end / mb:.1f} | "
            f"{statistics.median(takes) if takes else float('nan'):.1f} | "
            f"{statistics.median(restores) if restores else float('nan'):.1f} |"
        )


if __name__ == "__main__":
    main()
