"""Cost of LossScaleWatchdog on the healthy path: host reads per step and CPU time per step, 16-mixed on CPU.

Plain python, not a test:
``PYTHONPATH=$PWD python benchmarks/loss_scale_watchdog.py [--steps 60] [--rounds 3] [--width 256] [--depth 4]``
(float16 matmuls are slow on CPU: ``--width 512 --depth 12`` takes ~10 minutes.)

Variants (each a real ``Trainer.fit``, 16-mixed with the CPU GradScaler, ``log_every_n_steps=50``):
  * ``bare``: no nanguard callback;
  * ``monitor``: GradNormMonitor alone (pays the shared step health: one host read per step);
  * ``monitor+watchdog``: GradNormMonitor and LossScaleWatchdog (the watchdog should add no host read per step,
    only one on logging steps and one at train start);
  * ``watchdog``: LossScaleWatchdog alone (it then pays the shared step health itself).

Host reads are counted with ``lightning_nanguard.testing.HostReadCounter`` (``Tensor.item``/``tolist``/``numpy``/
``bool()``/``float()``/``int()`` by anyone, nanguard's own pinned host buffers excepted) over the whole fit, divided by
the steps, so Lightning's own reads and the once-per-fit ones are in every row; compare rows. Times are process CPU time with torch on 1 thread
(PERFORMANCE.md: wall time on this shared box is meaningless), median ms/step over rounds, variants rotated.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor, LossScaleWatchdog
from lightning_nanguard.testing import HostReadCounter


class MLP(pl.LightningModule):
    def __init__(self, width: int = 512, depth: int = 12) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.width = width

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, self.width, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=64)


class StepClock(pl.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(time.process_time())


def run(variant: str, steps: int, width: int, depth: int) -> tuple[float, float]:
    callbacks: list[pl.Callback] = {
        "bare": [],
        "monitor": [GradNormMonitor(layer_depth=None)],
        "monitor+watchdog": [GradNormMonitor(layer_depth=None), LossScaleWatchdog()],
        "watchdog": [LossScaleWatchdog()],
    }[variant]
    clock = StepClock()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2000)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        callbacks=[*callbacks, clock],
        logger=pl.loggers.CSVLogger("/tmp/nanguard_bench_lsw", name=variant),
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    pl.seed_everything(0, verbose=False)
    with HostReadCounter() as reads:
        trainer.fit(MLP(width, depth))
    deltas = [b - a for a, b in zip(clock.marks[2:], clock.marks[3:], strict=False)]  # skip 2 warm-up steps
    return statistics.median(deltas) * 1e3, reads.count / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = ["bare", "monitor", "monitor+watchdog", "watchdog"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    reads: dict[str, float] = {}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            ms, per_step = run(v, args.steps, args.width, args.depth)
            times[v].append(ms)
            reads[v] = per_step
    base = statistics.median(times["bare"])
    head = f"16-mixed MLP {args.depth}x{args.width}, {args.steps} steps, log_every_n_steps=50"
    print(f"{head}, CPU time, 1 thread, {args.rounds} rounds")
    print(f"{'variant':<18} {'ms/step':>9} {'ratio':>7} {'host reads/step':>16}")
    for v in variants:
        med = statistics.median(times[v])
        print(f"{v:<18} {med:>9.2f} {med / base:>7.3f} {reads[v]:>16.2f}")


if __name__ == "__main__":
    main()
