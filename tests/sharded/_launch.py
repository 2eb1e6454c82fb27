"""Run ``tests.sharded._worker`` (2 CPU ranks) in its own process group and read back what each rank wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_module(module: str, args: list[str], timeout: float) -> str:
    """``python -m module *args`` from the repository root in its own process group; its output.

    A hung collective fails the test after ``timeout`` seconds: the whole process group (the module and the ranks it
    launched) is killed, and the tail of its output is in the failure message.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"2-rank run timed out after {timeout}s (a hung collective?):\n{output[-4000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"2-rank run failed (exit {proc.returncode}):\n{output[-6000:]}")
    return output


def run_ranks(
    config: dict[str, Any], out_dir: str, timeout: float = 80.0, module: str = "tests.sharded._worker"
) -> dict[str, Any]:
    """Train with ``config`` on 2 ranks (``module``: ``tests.sharded._worker``, FSDP2/DDP, or
    ``tests.sharded._fsdp1_worker``, FSDP1); what each rank wrote:
    ``{"ranks": [rank0.json, rank1.json], "params": {name: full tensor}, "output": str}``."""
    return run_ranks_many([(config, out_dir)], timeout, module)[0]


def run_ranks_many(
    runs: list[tuple[dict[str, Any], str]], timeout: float = 80.0, module: str = "tests.sharded._worker"
) -> list[dict[str, Any]]:
    """``run_ranks`` for several configurations one after the other in ONE launch of the 2 ranks (the ranks start
    and join their process group once: most of a small run's time), each writing into its own directory."""
    for _, out_dir in runs:
        os.makedirs(out_dir, exist_ok=True)
    output = run_module(module, [json.dumps([[config, out_dir] for config, out_dir in runs]), "-"], timeout)
    results = []
    for _, out_dir in runs:
        ranks = []
        for r in (0, 1):
            with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as f:
                ranks.append(json.load(f))
        params = torch.load(os.path.join(out_dir, "params.pt"), weights_only=True)
        results.append({"ranks": ranks, "params": params, "output": output})
    return results


def run_checkpoint_ranks(config: dict[str, Any], out_dir: str, timeout: float = 80.0) -> list[dict[str, Any]]:
    """One 2-rank run of ``tests.sharded._ckpt_worker`` (CheckpointGuard under FSDP2); each rank's ``rank{r}.json``."""
    os.makedirs(out_dir, exist_ok=True)
    run_module("tests.sharded._ckpt_worker", [json.dumps(config), out_dir], timeout)
    ranks = []
    for r in (0, 1):
        with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as f:
            ranks.append(json.load(f))
    return ranks
