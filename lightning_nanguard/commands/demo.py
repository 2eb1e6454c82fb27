"""``nanguard demo``: one honest instability, trained unguarded and then with the preset, side by side."""

from __future__ import annotations

import argparse
import os
import sys

from lightning_nanguard.commands.table import LEGEND, Row, markdown

__all__ = ["DEFAULT_INCIDENT", "DEMO_FACTORY", "add_parser", "row_of"]

DEFAULT_INCIDENT = "bad-data"
DEMO_FACTORY = "lightning_nanguard.demo:demo_module"  # rebuilds a demo's module (it takes a network as an argument)


def row_of(result: object) -> Row:
    """A ``lightning_nanguard.demo.RunResult`` as a table row."""
    data = dict(vars(result))
    return Row.from_dict(data)


def _run(args: argparse.Namespace) -> int:
    from lightning_nanguard import default_callbacks
    from lightning_nanguard.demo import get_task, run_task, task_names

    if args.incident not in task_names():
        print(f"nanguard demo: unknown --incident {args.incident!r}; one of {', '.join(task_names())}", file=sys.stderr)
        return 2
    task = get_task(args.incident)
    root = os.path.abspath(args.root)
    print(f"nanguard demo: {task.name}: {task.description}")
    print(f"without nanguard: {task.failure}\n")
    results = []
    for config, callbacks in (("unguarded", []), ("preset", default_callbacks())):
        print(f"training {config} ...", flush=True)
        results.append(run_task(task.name, callbacks, seed=args.seed, root_dir=root, config=config))
    print()
    print(markdown([row_of(r) for r in results]))
    print()
    print(LEGEND)
    unguarded, guarded = results
    if unguarded.error:
        print(f"\nunguarded: {unguarded.error.splitlines()[0][:300]}")
    print("\nwith default_callbacks(), the incidents (step, cause, where, actions):")
    for inc in guarded.incidents[:12]:
        where = f" at {inc.where}" if inc.where else ""
        print(f"  step {inc.step:>5}  {inc.cause or inc.trigger}{where}: {', '.join(inc.actions or [inc.action])}")
    if len(guarded.incidents) > 12:
        print(f"  ... {len(guarded.incidents) - 12} more (nanguard report {guarded.log_dir})")
    if guarded.error:
        print(f"preset: {guarded.error.splitlines()[0][:300]}")
    bundle = next((inc.bundle for inc in guarded.incidents if inc.bundle), "")
    if bundle:
        print(f"\nreplay its first incident offline:  nanguard replay {bundle} --factory {DEMO_FACTORY}")
    print(f"\nsee both runs side by side:  tensorboard --logdir {os.path.join(root, task.name)}")
    return 0 if guarded.finished else 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small model on a real instability, unguarded and with the preset, and compare (CPU, < 1 min)",
        description="Train a small model on an honest instability (no injected NaN; CPU, no downloads), first "
        "without nanguard, then with lightning_nanguard.default_callbacks(); print both outcomes, the incidents "
        "with their causes, and the command to open TensorBoard on the two runs. Exit 0 when the preset saved the "
        "run, 1 when it did not.",
    )
    from lightning_nanguard.demo import task_names

    p.add_argument(
        "--incident",
        default=DEFAULT_INCIDENT,
        choices=task_names(),
        help=f"the mechanism (default {DEFAULT_INCIDENT})",
    )
    p.add_argument("--root", default="lightning_logs", help="TensorBoard root directory (default ./lightning_logs)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)
