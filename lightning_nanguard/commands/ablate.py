"""``nanguard ablate``: a grid of configurations x seeds, one process per run, and the table that compares them.

Two sources of runs:

* the demo tasks (``--task``), each under the configurations ``none``, ``all`` (the preset) and each stabilizer alone
  (``--configs`` picks a subset);
* your own LightningCLI entry point (``--entry train.py --yaml a.yaml b.yaml``): each YAML is one configuration, run
  as ``python train.py fit --config [BASE] --config a.yaml --seed_everything S --trainer.default_root_dir DIR``; the
  table is read back from the run's files (exit status, nanguard's incident log, quarantine file and end-of-fit
  check, the newest checkpoint, the TensorBoard scalars).

A run is "finished" when it returned normally with finite final weights: for your entry point, exit status 0 and
weights found finite by nanguard's end-of-fit check (its summary), else by the newest checkpoint the run wrote, else
(weights not readable: the note says so) a finite last training loss. Every unfinished run's reason is in the
table's last column. Unknown configurations, a missing entry script or YAML file are usage errors (exit 2) found
before anything runs.

Every run is its own TensorBoard run named ``<config>-seed<S>`` under ``--out``, so they overlay.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_nanguard.commands.table import LEGEND, Row, markdown, write_csv
from lightning_nanguard.preset import CALLBACKS

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

__all__ = ["CONFIGS", "add_parser", "run_one"]

# Every callback of the preset, in its order: "X" runs X alone, configured as in the preset.
STABILIZERS = tuple(cls.__name__ for cls in CALLBACKS)


CONFIGS = ("none", *STABILIZERS, "all")  # what --configs accepts


def _callbacks(config: str) -> list[Callback]:
    import lightning_nanguard as ng

    if config == "none":
        return []
    if config == "all":
        return list(ng.default_callbacks())
    if config in STABILIZERS:  # the stabilizer alone, configured as in the preset
        return list(ng.default_callbacks(**{name: name == config for name in STABILIZERS}))
    raise ValueError(f"unknown configuration {config!r}: none, all, or one of {', '.join(STABILIZERS)}")


def run_one(task: str, config: str, seed: int, root: str, out_json: str) -> None:
    """One demo run in this process; its row goes to ``out_json``."""
    from lightning_nanguard.commands.demo import row_of
    from lightning_nanguard.demo import run_task

    result = run_task(task, _callbacks(config), seed=seed, root_dir=root, config=config)
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(vars(row_of(result)), f)


def _user_row(entry: str, base: str | None, yaml: str, seed: int, out: str) -> Row:
    """Run the user's LightningCLI entry point with one configuration and read the outcome from its files."""
    config = os.path.splitext(os.path.basename(yaml))[0]
    run_dir = os.path.join(out, f"{config}-seed{seed}")
    cmd = [sys.executable, entry, "fit", *(["--config", base] if base else []), "--config", yaml]
    cmd += ["--seed_everything", str(seed), "--trainer.default_root_dir", run_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    row = Row("(entry)", config, seed, finished=False, wall_time=wall, log_dir=run_dir)
    from lightning_nanguard.reporting.incidents import IncidentLog

    incidents = [i for p in _found(run_dir, "incidents.jsonl") for i in IncidentLog.read(p)]
    row.incidents_by_cause = dict(Counter(i.cause or i.trigger for i in incidents))
    row.rollbacks = sum(1 for i in incidents if "rollback" in (i.actions or [i.action]))
    scalars = _last_scalars(run_dir)
    row.train_loss = next((v for k, v in scalars.items() if "train" in k and k.endswith("loss")), math.nan)
    row.val_loss = next((v for k, v in scalars.items() if "val" in k and k.endswith("loss")), math.nan)
    row.skipped_steps = _skipped(scalars, incidents, run_dir)
    row.lr_scale = scalars.get("nanguard/lr_scale", 1.0)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        row.error = f"exit status {proc.returncode}: {last}"
        return row
    finite, how = _final_weights(run_dir, row.train_loss)
    row.finished = finite
    row.note = how
    return row


def _found(run_dir: str, name: str) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "**", name), recursive=True))


def _final_weights(run_dir: str, train_loss: float) -> tuple[bool, str]:
    """Whether a run that exited 0 ended with finite weights, and a note where that was not read from the weights:
    nanguard's end-of-fit check (its summary), else the newest checkpoint, else the last logged training loss."""
    for path in _found(run_dir, "summary.txt"):
        with open(path, encoding="utf-8", errors="replace") as f:
            line = next((x for x in f if x.startswith("final parameters and buffers:")), "")
        state = line.split(":", 1)[1].strip() if line else ""
        if state:
            ok = state.startswith("finite") and "DIFFER" not in state
            return ok, "" if ok else f"final weights: {state}"
    from lightning_nanguard.checkpointing.verify import verify_checkpoint

    checkpoints = sorted(_found(run_dir, "*.ckpt"), key=os.path.getmtime)
    if checkpoints:
        result = verify_checkpoint(checkpoints[-1], require_sidecar=False)
        name = os.path.basename(checkpoints[-1])
        return result.ok, "" if result.ok else f"newest checkpoint {name}: {result.reason}"
    unread = "the weights could not be read (no nanguard summary, no checkpoint)"
    if math.isfinite(train_loss):
        return True, f"judged by the last training loss logged (finite): {unread}"
    return False, f"the last training loss logged is {train_loss} (or none was); {unread}"


def _skipped(scalars: dict[str, float], incidents: list[Any], run_dir: str) -> int:
    """Updates dropped: GradNormMonitor's counter where it logged one, else the incidents that dropped an update
    and the quarantined batches dropped without an incident (quarantine.json)."""
    if "nanguard/skipped_steps" in scalars:
        return int(scalars["nanguard/skipped_steps"])
    dropped = sum(1 for i in incidents if {"skip", "scaler_skip"} & set(i.actions or [i.action]))
    for path in _found(run_dir, "quarantine.json"):
        try:
            with open(path, encoding="utf-8") as f:
                dropped += int(json.load(f).get("dropped_batches", 0))
        except (OSError, ValueError, AttributeError, TypeError, RecursionError):  # a damaged list counts nothing
            continue
    return dropped


def _last_scalars(run_dir: str) -> dict[str, float]:
    files = glob.glob(os.path.join(run_dir, "**", "events.out.tfevents.*"), recursive=True)
    if not files:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.dirname(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: acc.Scalars(t)[-1].value for t in acc.Tags()["scalars"]}


def _grid(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    return [(task, config, seed) for task in args.task for config in configs for seed in args.seeds]


def _usage_error(args: argparse.Namespace) -> str:
    """What is wrong with the command line (``""``: nothing), found before anything runs."""
    if args.entry:
        if not args.yaml:
            return "--entry needs --yaml CONFIG [CONFIG ...]"
        missing = [p for p in [args.entry, *([args.base] if args.base else []), *args.yaml] if not os.path.isfile(p)]
        if missing:
            return f"no such file: {', '.join(missing)}"
        return ""
    unknown = [c for c in (args.configs.split(",") if args.configs else []) if c not in CONFIGS]
    if unknown:
        return f"unknown configuration(s) {', '.join(map(repr, unknown))} in --configs; the known ones: {', '.join(CONFIGS)}"
    from lightning_nanguard.demo import task_names

    unknown = [t for t in args.task if t not in task_names()]
    if unknown:
        return f"unknown --task {unknown}; one of {', '.join(task_names())}"
    return ""


def _run(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem:
        print(f"nanguard ablate: {problem}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    rows: list[Row] = []
    if args.entry:
        user_jobs = [(y, s) for y in args.yaml for s in args.seeds]
        for n, (yaml, seed) in enumerate(user_jobs, 1):
            print(f"[{n}/{len(user_jobs)}] {os.path.basename(yaml)} seed={seed} ...", end=" ", flush=True)
            row = _user_row(args.entry, args.base, yaml, seed, out)
            print(_outcome(row), flush=True)
            rows.append(row)
    else:
        jobs = _grid(args)
        for n, (task, config, seed) in enumerate(jobs, 1):
            print(f"[{n}/{len(jobs)}] {task} {config} seed={seed} ...", end=" ", flush=True)
            result = os.path.join(out, f".{task}-{config}-seed{seed}.json")
            cmd = [sys.executable, "-m", "lightning_nanguard.commands.ablate", task, config, str(seed), out, result]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not os.path.isfile(result):
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                row = Row(task, config, seed, finished=False, wall_time=time.perf_counter() - start, error=last)
            else:
                with open(result, encoding="utf-8") as f:
                    row = Row.from_dict(json.load(f))
                os.remove(result)
            print(_outcome(row), flush=True)
            rows.append(row)
    table = markdown(rows)
    print()
    print(table)
    print()
    print(LEGEND)
    with open(os.path.join(out, "ablation.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    write_csv(os.path.join(out, "ablation.csv"), rows)
    print(f"\nwritten: {os.path.join(out, 'ablation.md')}, {os.path.join(out, 'ablation.csv')}")
    print(f"overlay the runs:  tensorboard --logdir {out}")
    return 0


def _outcome(row: Row) -> str:
    if row.finished:
        return f"finished in {row.wall_time:.1f}s"
    return f"NOT FINISHED in {row.wall_time:.1f}s: {row.why()}"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ablate",
        help="run a grid of configurations (none, each stabilizer alone, all, or your YAMLs) and compare them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", nargs="+", default=["bad-data"], help="demo task(s) (default bad-data)")
    p.add_argument(
        "--configs",
        default="",
        help="comma list among " + ", ".join(CONFIGS) + " (default: all of them); an unknown one is a usage error",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default 0)")
    p.add_argument("--entry", help="your LightningCLI script (python ENTRY fit --config ...)")
    p.add_argument("--base", help="a base config passed before each --yaml")
    p.add_argument("--yaml", nargs="+", default=[], help="one LightningCLI config per configuration")
    p.add_argument(
        "--out", default="lightning_logs/ablation", help="output directory (default ./lightning_logs/ablation)"
    )
    p.set_defaults(func=_run)


def _main(argv: Sequence[str]) -> None:
    task, config, seed, root, out_json = argv
    run_one(task, config, int(seed), root, out_json)


if __name__ == "__main__":
    _main(sys.argv[1:])
