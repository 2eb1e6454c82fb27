"""The incident replay with origin tracing, as a multiple of one training step; and the origin checked on the device.

    PYTHONPATH=$PWD python benchmarks/replay_cost.py --device cuda            (about 30 s on one H100)
    PYTHONPATH=$PWD python benchmarks/replay_cost.py --device cpu --threads 1 --models gpt_small

Prints two markdown tables (and writes them to ``--out`` when given):

1. **Cost.** For each model and precision, interleaved round by round (wall time, the device synchronised around
   each): a plain training step (forward, backward, AdamW step), the hooked replay pass (``run_pass``, the coarse
   forensics), the traced pass (``trace_pass``: every aten op checked, anomaly mode on for backward lines: the pass
   an incident replays first), the traced pass without backward frames, and the float32 pass an incident adds under
   a half precision; medians, and each as a multiple of the step. The GPTs (``benchmarks/_models.py``) run a healthy
   batch: every op is checked, nothing is found, the most a trace costs.
2. **Origin on the device.** The tests' patterns (``tests/forensics/origin_models.py``: a division without eps in
   the forward, a sqrt whose gradient is inf in the backward, a ``torch.where`` masked branch, a fully masked
   softmax row) traced on ``--device``: the op, the phase and whether the line found is the marked line. On CUDA
   the backward runs in autograd's device threads, which must carry the dispatch mode and anomaly mode along.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

from _models import GPT, SMALL, GPTConfig  # noqa: E402

from lightning_nanguard.forensics.replay import run_pass, trace_pass  # noqa: E402
from tests.forensics import origin_models as om  # noqa: E402

MODELS = {
    "gpt_small": SMALL,
    "gpt_125m": GPTConfig("gpt_125m", layers=12, d=768, heads=12, seq=512, batch=8, vocab=50304),
}


def _to(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _timer(device: str) -> Any:
    def ms(fn: Any) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000.0

    return ms


def _plugin(precision: str, device: str) -> Any:
    return MixedPrecision(precision, torch.device(device).type) if precision.endswith("-mixed") else Precision()  # type: ignore[arg-type]


def cost(name: str, precision: str, device: str, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(MODELS[name], steps=1).to(device)
    model.log = lambda *a, **k: None  # type: ignore[method-assign]  # outside a fit: nothing to log into
    batch = _to(next(iter(model.train_dataloader())), device)
    plugin = _plugin(precision, device)
    stub = SimpleNamespace(precision_plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9, foreach=True)
    ms = _timer(device)

    def step() -> None:
        with plugin.train_step_context():
            loss = model.training_step(batch, 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = {
        "step": step,
        "hooked": lambda: run_pass(stub, model, batch, 0, float32=False),  # type: ignore[arg-type]
        "traced": lambda: trace_pass(stub, model, batch, 0),
        "traced_no_frames": lambda: trace_pass(stub, model, batch, 0, backward_frames=False),
        "float32": lambda: run_pass(stub, model, batch, 0, float32=True),  # type: ignore[arg-type]
    }
    for fn in runs.values():  # warm-up: kernels, allocator, autotuning
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for key, fn in runs.items():
            times[key].append(ms(fn))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    traced = trace_pass(stub, model, batch, 0)
    out["ops"] = float(traced.ops)
    return out


CHECKS: list[tuple[str, Any, str, str]] = [  # (pattern, model, precision, marker)
    ("division without eps (forward)", om.NormNoEps, "32-true", "norm"),
    ("sqrt at zero (backward)", om.PairDistance, "32-true", "sqrt"),
    ("torch.where masked branch", om.MaskedEntropy, "32-true", "where"),
    ("fully masked softmax row", lambda: om.MaskedAttention(fully_masked=True), "32-true", "softmax"),
    ("BCE on sigmoid probabilities", om.SigmoidBCE, "bf16-mixed", "bce"),
]


def check(device: str) -> list[str]:
    rows = []
    for pattern, make, precision, marker in CHECKS:
        model = make().to(device)
        batch = _to(list(model.train_dataloader())[om.BAD_BATCH], device)
        stub = SimpleNamespace(precision_plugin=_plugin(precision, device))
        start = time.perf_counter()
        try:
            traced = trace_pass(stub, model, batch, om.BAD_BATCH)
        except Exception as exc:  # a row per pattern, whatever one of them does
            rows.append(f"| {pattern} | {precision} | error: {type(exc).__name__}: {exc} | | | |")
            continue
        wall = (time.perf_counter() - start) * 1000.0
        o = traced.origin
        if o is None:
            rows.append(
                f"| {pattern} | {precision} | no origin ({traced.note or traced.result.error}) | | | {wall:.0f} |"
            )
            continue
        line_ok = o.frame is not None and o.frame.line == om.marker_line(marker)
        where = f"{os.path.basename(o.frame.file)}:{o.frame.line}" if o.frame else "no line"
        rows.append(
            f"| {pattern} | {precision} | {o.op} ({o.phase}{', ' + o.node if o.node else ''}) | {where} "
            f"| {'yes' if line_ok else 'NO'} | {wall:.0f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    parser.add_argument("--precision", nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    models = args.models or (["gpt_small", "gpt_125m"] if cuda else ["gpt_small"])
    precisions = args.precision or (["32-true", "bf16-mixed"] if cuda else ["32-true"])
    name = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    lines = [
        f"torch {torch.__version__}, {name}, {args.rounds} rounds (medians of wall time, device synchronised)",
        "",
        "| model | params | precision | aten ops | step (ms) | hooked pass (x step) | traced pass (x step) "
        "| traced, no backward frames (x step) | float32 pass (x step) | incident replay (x step) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for model in models:
        for precision in precisions:
            r = cost(model, precision, args.device, args.rounds)
            s = r["step"]
            half = precision.startswith(("16", "bf16"))
            replay = r["traced"] + (r["float32"] if half else 0.0)  # a reproduced half-precision fault adds it
            line = (
                f"| {model} | {r['params_m']:.1f}M | {precision} | {r['ops']:.0f} | {s:.1f} "
                f"| {r['hooked']:.1f} ({r['hooked'] / s:.2f}) | {r['traced']:.1f} ({r['traced'] / s:.2f}) "
                f"| {r['traced_no_frames']:.1f} ({r['traced_no_frames'] / s:.2f}) "
                f"| {r['float32']:.1f} ({r['float32'] / s:.2f}) | {replay / s:.2f} |"
            )
            lines.append(line)
            print(line, flush=True)
    table = [
        "",
        f"origin on {args.device}:",
        "",
        "| pattern | precision | origin op (phase) | line found | is the marked line | trace (ms) |",
        "|---|---|---|---|---|---|",
        *check(args.device),
    ]
    print("\n".join(table), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines + table) + "\n")


if __name__ == "__main__":
    main()
