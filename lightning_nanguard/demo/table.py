"""Every demo task under none / the preset / each callback alone: one Markdown table.

Usage::

    python -m lightning_nanguard.demo.table [--tasks bad-data,bn-poison] [--seed 0] [--root-dir DIR] [--out FILE]

Columns: finished; final train and validation loss as a multiple of the healthy run's (the fault removed);
incidents by cause; rollbacks; OptimizerBackoff's LR scale at the end; the remedy cost (the final train loss vs
healthy, the updates dropped, the steps of training the rollbacks undid); wall time of ``fit`` as a multiple of the
healthy run's (the healthy and preset runs are timed ``--repeats`` times, the fastest kept); ``preset-nofault`` is the preset on the
healthy task, the suite's cost when nothing goes wrong. Each run is a TensorBoard run under
``<root-dir>/<task>/<config>-seed<seed>``, so ``tensorboard --logdir <root-dir>`` overlays them.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Sequence

import torch

from lightning_nanguard.demo.presets import CONFIGS
from lightning_nanguard.demo.registry import get_task, task_names
from lightning_nanguard.demo.runner import RunResult, run_task

__all__ = ["format_table", "main", "remedy_cost", "run_grid"]

_TIMED = ("healthy", "preset", "preset-nofault")
# The preset on the healthy task: what the suite costs when nothing goes wrong (its fixed per-fit cost included).
NOFAULT = "preset-nofault"


def run_grid(
    tasks: Sequence[str], configs: Sequence[str], *, seed: int, root_dir: str, repeats: int = 2
) -> dict[str, list[RunResult]]:
    """``{task: [healthy, *configs]}``, in that order; the healthy and preset runs ``repeats`` times in
    interleaved rounds (fastest kept)."""
    out: dict[str, list[RunResult]] = {}
    run_task(tasks[0], [], seed=seed, root_dir=root_dir, healthy=True, config="warmup")  # imports, first-fit costs
    for name in tasks:
        every = ("healthy", *configs)
        runs: dict[str, list[RunResult]] = {config: [] for config in every}
        timed = [config for config in every if config in _TIMED]
        # The timed configurations in interleaved rounds, the order rotated each round: a slow spell of a shared
        # machine then hits every configuration alike instead of all the repeats of one.
        for i in range(repeats):
            k = i % len(timed)
            for config in timed[k:] + timed[:k]:
                runs[config].append(_one(name, config, seed, root_dir, i))
        for config in every:
            if config not in _TIMED:
                runs[config].append(_one(name, config, seed, root_dir, 0))
        out[name] = [min(runs[config], key=lambda r: r.wall_time) for config in every]
    return out


def _one(name: str, config: str, seed: int, root_dir: str, repeat: int) -> RunResult:
    healthy = config in ("healthy", NOFAULT)
    callbacks = [] if config == "healthy" else CONFIGS["preset" if config == NOFAULT else config]()
    label = config if repeat == 0 else f"{config}~{repeat}"
    return run_task(name, callbacks, seed=seed, root_dir=root_dir, healthy=healthy, config=label)


def _ratio(value: float, ref: float) -> str:
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    if not math.isfinite(ref) or ref <= 0:
        return f"{value:.3g}"
    r = value / ref
    return f"{r:.2f}x" if r < 1e3 else f"{r:.1e}x"


def format_table(grid: dict[str, list[RunResult]]) -> str:
    """The Markdown table of ``run_grid``'s results, then each preset run's incidents."""
    lines = [f"- **{name}** ({get_task(name).precision}): {get_task(name).description}" for name in grid]
    lines += [
        "",
        "| task | config | finished | train vs healthy | val vs healthy | incidents (by cause) | rollbacks "
        "| LR scale | remedy cost | wall vs healthy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (healthy, *rest) in grid.items():
        lines.append(
            f"| {name} | healthy | {_yes(healthy)} | {healthy.train_loss:.3g} | {healthy.val_loss:.3g} | "
            f"{_causes(healthy)} | {healthy.rollbacks} | {healthy.lr_scale:.3g} | - | {healthy.wall_time:.2f}s |"
        )
        for r in rest:
            config = r.config.split("~")[0]
            lines.append(
                f"| {name} | {config} | {_yes(r)} | {_ratio(r.train_loss, healthy.train_loss)} | "
                f"{_ratio(r.val_loss, healthy.val_loss)} | {_causes(r)} | {r.rollbacks} | {r.lr_scale:.3g} | "
                f"{remedy_cost(r, healthy)} | {_ratio(r.wall_time, healthy.wall_time)} ({r.wall_time:.2f}s) |"
            )
    lines += ["", "Preset runs, every incident (step: cause or trigger -> actions @ where):", ""]
    for name, results in grid.items():
        for r in results:
            if not r.config.startswith("preset") or r.config.startswith(NOFAULT):
                continue
            lines.append(f"- **{name}**" + (f" (error: {r.error[:200]})" if r.error else ""))
            for inc in r.incidents:
                acts = ", ".join(inc.actions or [inc.action])
                where = f" @ {inc.where[:90]}" if inc.where else ""
                lines.append(f"  - step {inc.step}: {inc.cause or inc.trigger} -> {acts}{where}")
    return "\n".join(lines)


def remedy_cost(r: RunResult, healthy: RunResult) -> str:
    """``"1.07x; 15 dropped; 0 rolled back"``: what the remedies cost the run (nothing where nothing happened)."""
    if not r.incidents:
        return "-"
    return f"{_ratio(r.train_loss, healthy.train_loss)}; {r.skipped_steps} dropped; {r.steps_rolled_back} rolled back"


def _yes(r: RunResult) -> str:
    if r.finished:
        return "yes"
    return "no (" + (r.error.split(":")[0] if r.error else "non-finite") + ")"


def _causes(r: RunResult) -> str:
    return ", ".join(f"{c}={n}" for c, n in sorted(r.incidents_by_cause.items())) or "-"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_nanguard.demo.table", description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default=",".join(task_names()), help="comma list (default: every task)")
    choices = [*CONFIGS, NOFAULT]
    parser.add_argument("--configs", default=",".join(choices), help=f"comma list of {', '.join(choices)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of healthy/preset (the fastest is kept)")
    parser.add_argument("--root-dir", default=None, help="TensorBoard root (default: a new temporary directory)")
    parser.add_argument("--out", default=None, help="also write the Markdown here")
    args = parser.parse_args(argv)
    tasks = [get_task(t).name for t in args.tasks.split(",") if t]
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in choices:
            parser.error(f"unknown config {c!r}; one of {', '.join(choices)}")
    root = args.root_dir or tempfile.mkdtemp(prefix="nanguard-demo-")
    torch.set_num_threads(1)  # timings comparable on a shared machine
    warnings.simplefilter("ignore")
    for logger in ("lightning.pytorch", "lightning.fabric", "lightning_nanguard"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    text = format_table(run_grid(tasks, configs, seed=args.seed, root_dir=root, repeats=max(1, args.repeats)))
    print(text)
    print(f"\nTensorBoard runs: tensorboard --logdir {root}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
