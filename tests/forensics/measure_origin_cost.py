"""The cost of a replay pass with origin tracing, as a multiple of one training step (not a test: run it by hand).

    python tests/forensics/measure_origin_cost.py --threads 1 [--rounds 5] [--models tiny gpt_10m]

For each model, interleaved round by round and in process CPU time (steadier than wall time on a shared machine):
a plain training step (forward, backward, AdamW step), the hooked replay pass (``run_pass``), the traced pass
(``trace_pass``: every aten op checked, anomaly mode on for backward frames) and the traced pass without backward
frames (anomaly mode off), as medians and as multiples of the step. ``tiny`` is the tests' normalisation model on
its all-zero record (the pass reproduces: the origin is found); ``gpt_small`` and ``gpt_10m`` are transformers on a
healthy batch (every op is checked, nothing found).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _models import GPT, SMALL, GPTConfig  # noqa: E402

from lightning_nanguard.forensics.replay import run_pass, trace_pass  # noqa: E402
from tests.forensics import origin_models  # noqa: E402

GPT_10M = GPTConfig("gpt_10m", layers=6, d=320, heads=4, seq=128, batch=8, vocab=8192)


def _cpu_ms(fn: Any) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000.0


def _model(name: str) -> tuple[Any, Any, int]:
    if name == "tiny":
        model = origin_models.NormNoEps()
        batch = list(model.train_dataloader())[origin_models.BAD_BATCH]
        return model, batch, origin_models.BAD_BATCH
    model = GPT(SMALL if name == "gpt_small" else GPT_10M, steps=1)
    model.log = lambda *a, **k: None  # type: ignore[method-assign]  # outside a fit: nothing to log into
    return model, next(iter(model.train_dataloader())), 0


def measure(name: str, precision: str, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, batch, idx = _model(name)
    plugin = MixedPrecision(precision, "cpu") if precision.endswith("-mixed") else Precision()  # type: ignore[arg-type]
    stub = SimpleNamespace(precision_plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9)

    def step() -> None:
        with plugin.train_step_context():
            loss = model.training_step(batch, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"step": [], "hooked": [], "traced": [], "traced_no_frames": []}
    out: list[Any] = []
    for _ in range(rounds):
        times["step"].append(_cpu_ms(step))
        times["hooked"].append(_cpu_ms(lambda: run_pass(stub, model, batch, idx, float32=False)))  # type: ignore[arg-type]
        out.clear()
        times["traced"].append(_cpu_ms(lambda: out.append(trace_pass(stub, model, batch, idx))))
        times["traced_no_frames"].append(_cpu_ms(lambda: trace_pass(stub, model, batch, idx, backward_frames=False)))
    result = {k: statistics.median(v) for k, v in times.items()}
    result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    result["found"] = float(out[0].origin is not None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["tiny", "gpt_small", "gpt_10m"])
    parser.add_argument("--precision", nargs="+", default=["32-true"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {args.rounds} rounds (medians)")
    print(
        "| model | params | precision | origin found | step, CPU (ms) | hooked pass (x step) | traced pass (x step) "
        "| traced, no backward frames (x step) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for precision in args.precision:
            r = measure(name, precision, args.rounds)
            s = r["step"]
            print(
                f"| {name} | {r['params_m']:.2f}M | {precision} | {'yes' if r['found'] else 'no (healthy)'} "
                f"| {s:.1f} | {r['hooked']:.1f} ({r['hooked'] / s:.2f}) | {r['traced']:.1f} ({r['traced'] / s:.2f}) "
                f"| {r['traced_no_frames']:.1f} ({r['traced_no_frames'] / s:.2f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
