"""What the best remedy for a warmup that overshoots could reach, and how far the healthy run itself moves with its rate.

    PYTHONPATH=$PWD python benchmarks/remedy_oracle.py                     (about 4.5 min on 2 CPU cores)
    PYTHONPATH=$PWD python benchmarks/remedy_oracle.py --only sensitivity  (about 1 min)

``benchmarks/divergence_cost.py`` measures what the preset's catch of a divergence costs. This script asks what any
rollback-and-cap remedy could cost at best, without the preset: no detection, the remedy forced by hand.

* ``sensitivity``: the healthy run itself with its learning rate scaled by 0.8-1.2x at every step, against the
  healthy run. A remedy that holds the rate at a cap pays at least this for a cap that far from the tuned rate.
* ``restore``: the overshooting run with its state restored at step ``--at`` (33: about where the preset catches
  it) to the state of an earlier step (0-33; 33 is no rollback at all, the rate only), the rate then held at a cap
  (0.75x, 1x and 1.2x the healthy peak 0.075).
* ``early``: as if the divergence were caught at an earlier step (12-26), the state restored to 5 steps before it
  and the rate held at 0.5x, 0.7x or 0.85x the rate of that step.

Each figure is the ratio of mean final losses over the runs (``divergence_cost.py``'s measure): for the demo's
``spike-then-diverge`` over the seeds among ``--seeds`` whose unguarded run diverges (train / val), for the
regression warmup of ``tests/regressions/test_probe_catches_a_divergence.py`` over ``--orders`` data orders.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from divergence_cost import data_orders, diverging_seeds

from lightning_nanguard.demo import run_task
from lightning_nanguard.demo.tasks import spike_then_diverge as demo_task
from tests.regressions import test_probe_catches_a_divergence as regression

PEAK = regression.STABLE  # the healthy peak rate of both runs (the demo's HEALTHY_PEAK)
FAULTY = demo_task.FAULTY_PEAK  # both overshoot to 4x it over a 40-step warmup


def _overshoot_rate(step: int) -> float:
    return FAULTY * min(1.0, (step + 1) / demo_task.WARMUP_STEPS)


class _Forced(Callback):
    """At step ``at``, restore the state (weights, optimizer) of step ``source``; from then on hold the rate at
    ``cap``."""

    def __init__(self, source: int, at: int, cap: float) -> None:
        self.source, self.at, self.cap = source, at, cap
        self.saved: tuple[dict[str, Any], list[dict[str, Any]]] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.source and self.saved is None:
            self.saved = (
                copy.deepcopy(pl_module.state_dict()),
                [copy.deepcopy(o.state_dict()) for o in trainer.optimizers],
            )
        if trainer.global_step == self.at and self.saved is not None and self.source != self.at:
            pl_module.load_state_dict(self.saved[0])
            for opt, state in zip(trainer.optimizers, self.saved[1], strict=True):
                opt.load_state_dict(state)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step >= self.at:
            for group in optimizer.param_groups:
                group["lr"] = self.cap


class _Scaled(Callback):
    """The schedule's rate times ``factor`` at every step (``LambdaLR`` sets each step's rate afresh)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["lr"] *= self.factor


class _Runs:
    """Both tasks' runs with extra callbacks, as ratios of means against their healthy runs (computed once)."""

    def __init__(self, root: str, seeds: int, orders: int) -> None:
        self.root = root
        self.seeds = diverging_seeds(demo_task.TASK.name, seeds, root)
        self.orders = data_orders(orders)
        healthy = [self._demo([], s, healthy=True) for s in self.seeds]
        self.demo_healthy = tuple(statistics.fmean(h[i] for h in healthy) for i in (0, 1))
        self.regression_healthy = statistics.fmean(self._regression(regression._warmup, [], o) for o in self.orders)

    def _demo(self, callbacks: list[Callback], seed: int, *, healthy: bool = False) -> tuple[float, float]:
        run = run_task(demo_task.TASK.name, callbacks, seed=seed, root_dir=self.root, healthy=healthy, config="oracle")
        return run.train_loss, run.val_loss

    def _regression(self, schedule: Any, callbacks: list[Callback], order: int | None) -> float:
        return regression._fit(schedule, callbacks, f"{self.root}/regression", order)[2]

    def demo(self, make: Any, *, healthy: bool = False) -> str:
        runs = [self._demo([make()], s, healthy=healthy) for s in self.seeds]
        train, val = (statistics.fmean(r[i] for r in runs) / self.demo_healthy[i] for i in (0, 1))
        return f"{train:.3f}x / {val:.3f}x"

    def regression(self, make: Any, schedule: Any = regression._overshoot) -> str:
        mean = statistics.fmean(self._regression(schedule, [make()], o) for o in self.orders)
        return f"{mean / self.regression_healthy:.3f}x"


def _sensitivity(runs: _Runs) -> list[str]:
    rows = ["| healthy rate x | demo train / val | regression |", "|---|---|---|"]
    for factor in (0.8, 0.9, 0.95, 1.05, 1.1, 1.2):
        demo = runs.demo(lambda f=factor: _Scaled(f), healthy=True)
        reg = runs.regression(lambda f=factor: _Scaled(f), regression._warmup)
        rows.append(f"| {factor} | {demo} | {reg} |")
    return rows


def _restore(runs: _Runs, at: int) -> list[str]:
    caps = (0.75 * PEAK, PEAK, 1.2 * PEAK)
    head = " | ".join(f"cap {c:.3g}: demo train / val / regression" for c in caps)
    rows = [f"| restored to (at step {at}) | {head} |", "|---" * (len(caps) + 1) + "|"]
    for source in (*(s for s in (0, 5, 10, 15, 20, 25, 30) if s < at), at):
        cells = [
            f"{runs.demo(lambda s=source, c=cap: _Forced(s, at, c))} / "
            f"{runs.regression(lambda s=source, c=cap: _Forced(s, at, c))}"
            for cap in caps
        ]
        rows.append(f"| step {source}{' (no rollback)' if source == at else ''} | {' | '.join(cells)} |")
    return rows


def _early(runs: _Runs) -> list[str]:
    shares = (0.5, 0.7, 0.85)
    head = " | ".join(f"cap {f}x its rate: demo train / val / regression" for f in shares)
    rows = [f"| caught at (restored to 5 before) | {head} |", "|---" * (len(shares) + 1) + "|"]
    for at in (12, 15, 18, 22, 26):
        cells = []
        for share in shares:
            cap = share * _overshoot_rate(at)
            make = lambda a=at, c=cap: _Forced(a - 5, a, c)  # noqa: E731 - one factory per cell
            cells.append(f"{cap:.3f}: {runs.demo(make)} / {runs.regression(make)}")
        rows.append(f"| step {at} (rate {_overshoot_rate(at):.3f}) | {' | '.join(cells)} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="seeds of the demo task (those that diverge count)")
    parser.add_argument("--orders", type=int, default=10, help="data orders of the regression warmup")
    parser.add_argument("--at", type=int, default=33, help="the step of the forced rollback in the restore table")
    parser.add_argument("--only", choices=("sensitivity", "restore", "early"), help="one table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with TemporaryDirectory() as root:
        runs = _Runs(root, args.seeds, args.orders)
        print(f"demo spike-then-diverge: seeds {runs.seeds} diverge unguarded; regression: {len(runs.orders)} orders")
        tables = {"sensitivity": _sensitivity, "restore": lambda r: _restore(r, args.at), "early": _early}
        for name, table in tables.items():
            if args.only in (None, name):
                print(f"\n{name}\n" + "\n".join(table(runs)), flush=True)


if __name__ == "__main__":
    main()
