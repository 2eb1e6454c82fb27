"""How long the ``nanguard`` command takes to answer: ``--version``, ``report`` and ``verify`` (docs/PERFORMANCE.md).

    python benchmarks/cli_startup.py [--rounds 5] [--checkouts . ../other-checkout]

Each command runs in a fresh interpreter (``python -m lightning_nanguard.cli``, what the console script runs) with
``PYTHONPATH`` set to each checkout in turn (default: this one), ``rounds`` times, interleaved; the table gives the
median, fastest and slowest wall time and the median CPU time (user + system, what the command costs
on an idle core), beside the bare imports of torch and Lightning for scale. The fixtures are a run
directory with its ``nanguard/`` files and a small checkpoint with its checksum sidecar, in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fixtures(root: str) -> tuple[str, str]:
    run = os.path.join(root, "run")
    os.makedirs(os.path.join(run, "nanguard"))
    record = {"step": 3, "trigger": "nonfinite_loss", "action": "skip", "actions": ["skip"], "cause": "bad_input"}
    with open(os.path.join(run, "nanguard", "incidents.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    ckpt = os.path.join(root, "model.ckpt")
    make = (
        "import sys, torch; from lightning_nanguard.checkpointing.verify import write_sidecar; "
        "torch.save({'state_dict': {'w': torch.ones(64, 64)}}, sys.argv[1]); write_sidecar(sys.argv[1])"
    )
    subprocess.run([sys.executable, "-c", make, ckpt], check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return run, ckpt


def _time(cmd: list[str], cwd: str, checkout: str) -> tuple[float, float]:
    """Wall time, and CPU time (user + system: what the command costs on an idle core, whatever else runs)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # Outside the checkout: ``python -m`` puts the working directory first on sys.path, ahead of PYTHONPATH.
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--checkouts", nargs="+", default=[ROOT], help="checkouts to time (default: this one)")
    args = parser.parse_args()
    checkouts = [os.path.abspath(c) for c in args.checkouts]
    load = f"{os.getloadavg()[0]:.1f}"
    cli = [sys.executable, "-m", "lightning_nanguard.cli"]
    with tempfile.TemporaryDirectory() as root:
        run, ckpt = _fixtures(root)
        rows = {
            "nanguard --version": [*cli, "--version"],
            "nanguard report RUN": [*cli, "report", run],
            "nanguard verify CKPT": [*cli, "verify", ckpt],
            "nanguard demo --help": [*cli, "demo", "--help"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "python -c 'import lightning.pytorch'": [sys.executable, "-c", "import lightning.pytorch"],
        }
        times: dict[tuple[str, str], list[tuple[float, float]]] = {(name, c): [] for name in rows for c in checkouts}
        for _ in range(args.rounds):
            for (name, checkout), ts in times.items():
                if name.startswith("python") and checkout != checkouts[0]:
                    continue  # the bare imports do not depend on the checkout
                ts.append(_time(rows[name], root, checkout))
    print(f"{args.rounds} rounds, {sys.executable}\n")
    print(f"load average before and after: {load} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| command | checkout | wall, median | wall, fastest | wall, slowest | CPU time, median |")
    print("|---|---|---|---|---|---|")
    for (name, checkout), ts in times.items():
        if ts:
            wall, cpu = [t for t, _ in ts], [c for _, c in ts]
            print(
                f"| `{name}` | {checkout} | {statistics.median(wall):.2f} s | {min(wall):.2f} s | {max(wall):.2f} s "
                f"| {statistics.median(cpu):.2f} s |"
            )


if __name__ == "__main__":
    main()
