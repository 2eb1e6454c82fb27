"""Short fits with the preset and forked DataLoader workers on CUDA, repeated for a time budget, counting failures.

    PYTHONPATH=$PWD python benchmarks/gpu_dataloader.py --seconds 90 --out DIR

Two phases, written to ``DIR/gpu_dataloader.json`` (and a line of ``DIR/gpu_dataloader.md``) after every fit:

* **unguarded** (``--unguarded`` fits, 2 by default): nanguard's fork guard (``recovery/host_memory.py``) kept off,
  the parent's garbage collector off between fits (so the previous fit's Trainer, with the engine's page-locked
  host mirror, is still garbage when the next fit forks its workers), and a dataset whose ``__getitem__`` runs the
  collector in the worker. A fit after the first is expected to lose a worker with ``cudaErrorInitializationError``:
  the mechanism behind the crash, with nanguard's own objects;
* **guarded**: the guard on, the issue's loader (2 workers, persistent, pinned memory) with the preset, alternating
  a plain dataset and the collecting one, for the rest of the time. Expected: no failure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_nanguard as ng
from lightning_nanguard.recovery import host_memory

CUDA = torch.cuda.is_available()
_COLLECTED: dict[str, int] = {}  # the process that collected already (one per worker)


def log(msg: str) -> None:
    print(f"[gpu_dataloader.py {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A regression dataset; with ``collect``, each worker runs a full garbage collection at its first item (what a
    worker that allocates enough would do by itself, sooner or later)."""

    def __init__(self, n: int, collect: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = self.x[:, :1] * 0.5
        self.collect = collect

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.collect and _COLLECTED.get("pid") != os.getpid():
            _COLLECTED["pid"] = os.getpid()
            gc.collect()
        return self.x[i], self.y[i]


class Model(pl.LightningModule):
    def __init__(self, collect: bool, persistent: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 1))
        self.collect, self.persistent = collect, persistent

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=CUDA)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            Rows(64 * 16, self.collect),
            batch_size=16,
            num_workers=2,
            persistent_workers=self.persistent,
            pin_memory=CUDA,
            timeout=15,  # a worker lost to the crash fails the fit after this, not a minute later
            multiprocessing_context="fork",
        )


def one_fit(collect: bool, persistent: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cuda" if CUDA else "cpu",
            devices=1,
            precision="bf16-mixed" if CUDA else "32-true",
            max_epochs=1,  # the loader runs to its end: its workers are shut down at the epoch's end
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=root,
            callbacks=ng.default_callbacks(),
        )
        t0 = time.perf_counter()
        try:
            trainer.fit(Model(collect, persistent))
            return {"ok": True, "s": round(time.perf_counter() - t0, 2)}
        except Exception as exc:
            return {"ok": False, "s": round(time.perf_counter() - t0, 2), "error": f"{type(exc).__name__}: {exc}"[:400]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--unguarded", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "unguarded": [],
        "guarded": [],
    }

    def save() -> None:
        guarded = results["guarded"]
        results["summary"] = {
            "unguarded_failures": sum(not r["ok"] for r in results["unguarded"]),
            "unguarded_fits": len(results["unguarded"]),
            "guarded_failures": sum(not r["ok"] for r in guarded),
            "guarded_fits": len(guarded),
        }
        with open(os.path.join(args.out, "gpu_dataloader.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        s = results["summary"]
        with open(os.path.join(args.out, "gpu_dataloader.md"), "w", encoding="utf-8") as f:
            f.write(
                f"DataLoader workers on {results['device']}: unguarded {s['unguarded_failures']} failed of "
                f"{s['unguarded_fits']} fits; guarded {s['guarded_failures']} failed of {s['guarded_fits']} fits\n"
            )

    host_memory._FORK_GUARD["installed"] = True  # phase 1: the guard is never registered
    gc.disable()
    for i in range(args.unguarded):
        row = {"fit": i, **one_fit(collect=True, persistent=False)}
        results["unguarded"].append(row)
        log(f"unguarded fit {i}: {row}")
        save()
    gc.enable()
    gc.collect()
    host_memory._FORK_GUARD["installed"] = False
    host_memory.protect_forked_children()  # phase 2: as nanguard installs it
    i = 0
    while time.perf_counter() - start < args.seconds:
        collect = i % 2 == 1
        row = {"fit": i, "collect": collect, **one_fit(collect=collect, persistent=True)}
        results["guarded"].append(row)
        if not row["ok"] or i % 5 == 0:
            log(f"guarded fit {i}: {row}")
        save()
        i += 1
    log(f"done: {results['summary']}")


if __name__ == "__main__":
    main()
