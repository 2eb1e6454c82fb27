"""What a divergence caught by the probe costs: the preset's final loss against the healthy run's, as ratios of means.

    PYTHONPATH=$PWD python benchmarks/divergence_cost.py                           (about 30 s on 2 CPU cores)
    PYTHONPATH=$PWD python benchmarks/divergence_cost.py --orders 20 --seeds 10    (about 1 min)

One fit's final loss is no yardstick at the 1.05x level: the same run with another data order ends +-12% apart
(docs/FORENSICS.md). So each figure is the preset's mean final loss over many runs against the healthy run's mean
over the same ones: over ``--orders`` data orders for the regression runs of
``tests/regressions/test_probe_catches_a_divergence.py`` (a warmup that overshoots to 4x the stable rate, a constant
rate that jumps 10x), over the seeds among ``--seeds`` whose unguarded run ends non-finite for the demo tasks
``spike-then-diverge`` and ``lr-restart`` (at the other seeds the fault is survived, and there is nothing to catch),
and over ``--orders`` data orders for the small Transformer of
``tests/regressions/test_probe_catches_attention_divergence.py`` (attention logits that run away at a peak 10x too
high, against the same model at a sound peak, and that peak 10% off: the criterion's bar).
Each row also lists every run's incidents (trigger, step, the step restored). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_nanguard import default_callbacks
from lightning_nanguard.demo import run_task
from lightning_nanguard.engine import get_engine
from tests.regressions import test_probe_catches_a_divergence as regression
from tests.regressions import test_probe_catches_attention_divergence as attention

REGRESSION: dict[str, Callable[[int], float]] = {
    "warmup-overshoot": regression._overshoot,
    "lr-jump-10x": regression._jump,
}
DEMO = ("spike-then-diverge", "lr-restart")


def _restores(records: list[Any]) -> str:
    """``"probe_rose@33->0"`` for each incident (its trigger, step and the step it restored)."""
    parts = [f"{r.trigger}@{r.step}->{r.values.get('restored_from_step', '-')}" for r in records]
    return " ".join(parts) or "none"


def data_orders(count: int) -> list[int | None]:
    """The first ``count`` data orders of a regression run (``None``: the order the module's initialization leaves)."""
    return [None, *range(count - 1)]


def diverging_seeds(name: str, seeds: int, root: str) -> list[int]:
    """The seeds among ``range(seeds)`` whose unguarded run of demo task ``name`` ends non-finite."""
    return [s for s in range(seeds) if not run_task(name, [], seed=s, root_dir=root, config=f"u{s}").finished]


def _regression(name: str, orders: int, steps: int, root: str) -> tuple[str, float, list[str]]:
    regression.STEPS = steps
    healthy_schedule, _ = regression.HEALTHY[name]
    preset, healthy, caught = [], [], []
    for order in data_orders(orders):
        trainer, _, final = regression._fit(REGRESSION[name], default_callbacks(), f"{root}/p-{name}-{order}", order)
        preset.append(final)
        caught.append(_restores(get_engine(trainer).sink.records))
        healthy.append(regression._fit(healthy_schedule, [], f"{root}/h-{name}-{order}", order)[2])
    return f"{name} ({steps} steps, {orders} orders)", statistics.fmean(preset) / statistics.fmean(healthy), caught


def _demo(name: str, seeds: int, root: str) -> tuple[str, float, float, list[str]]:
    """Over the seeds whose unguarded run ends non-finite (at some seeds the fault is survived: nothing to catch)."""
    diverging = diverging_seeds(name, seeds, root)
    label = f"demo {name} ({len(diverging)} of {seeds} seeds diverge unguarded)"
    if not diverging:
        return label, math.nan, math.nan, []
    runs = [run_task(name, default_callbacks(), seed=s, root_dir=root, config=f"p{s}") for s in diverging]
    healthy = [run_task(name, [], seed=s, root_dir=root, healthy=True, config=f"h{s}") for s in diverging]
    train = statistics.fmean(r.train_loss for r in runs) / statistics.fmean(h.train_loss for h in healthy)
    val = statistics.fmean(r.val_loss for r in runs) / statistics.fmean(h.val_loss for h in healthy)
    caught = [_restores(r.incidents) if r.finished else f"unfinished: {r.error[:60]}" for r in runs]
    return label, train, val, caught


def _attention(orders: int, root: str) -> tuple[str, float, tuple[float, float], list[str]]:
    """The small Transformer whose attention runs away at a peak 10x too high, against the same model at a sound
    peak, over ``orders`` data orders; and the sound peak itself 10% off (0.9x, 1.1x) against it: the bar."""
    preset, healthy, low, high, caught = [], [], [], [], []
    for order in range(orders):
        trainer, _, final = attention._fit(attention.TOO_HIGH, default_callbacks(), order, f"{root}/a-p{order}")
        preset.append(final)
        caught.append(_restores(get_engine(trainer).sink.records))
        healthy.append(attention._fit(attention.SOUND, [], order, f"{root}/a-h{order}")[2])
        low.append(attention._fit(0.9 * attention.SOUND, [], order, f"{root}/a-l{order}")[2])
        high.append(attention._fit(1.1 * attention.SOUND, [], order, f"{root}/a-u{order}")[2])
    base = statistics.fmean(healthy)
    label = f"attention runaway (Transformer, {attention.STEPS} steps, {orders} orders; healthy: the sound peak)"
    return label, statistics.fmean(preset) / base, (statistics.fmean(low) / base, statistics.fmean(high) / base), caught


def _x(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{ratio:.3f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=5, help="data orders of each regression run")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of each demo task")
    parser.add_argument("--steps", type=int, default=regression.STEPS, help="optimizer steps of the regression runs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rows = [
        "| run | final loss vs healthy (ratio of means) | catches (trigger@step->restored step), each |",
        "|---|---|---|",
    ]
    with TemporaryDirectory() as root:
        for name in REGRESSION:
            label, ratio, caught = _regression(name, args.orders, args.steps, root)
            rows.append(f"| {label} | {ratio:.3f}x | {'; '.join(caught)} |")
        for name in DEMO:
            label, train, val, caught = _demo(name, args.seeds, root)
            rows.append(f"| {label} | train {_x(train)} / val {_x(val)} | {'; '.join(caught)} |")
        label, ratio, (low, high), caught = _attention(args.orders, root)
        rows.append(f"| {label} | {ratio:.3f}x | {'; '.join(caught)} |")
        rows.append(f"| the sound peak at 0.9x / 1.1x (the bar) | {low:.3f}x / {high:.3f}x | - |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
