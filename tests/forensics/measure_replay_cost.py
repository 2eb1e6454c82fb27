"""Replay cost on the incident path, measured on the benchmarks' small GPT (not a test: run it by hand).

    python tests/forensics/measure_replay_cost.py [--precision 32-true bf16-mixed] [--rounds 5]

For each precision: the median wall time of a healthy training step in a fit (batch start to batch end) and the
replay cost the incident records (``diagnosis.replay_ms``: a ``FaultInjector`` loss fault that does not reproduce, so
one hooked pass); then, interleaved round by round and in process CPU time (steadier than wall time on a shared
machine), a plain training step (forward, backward, AdamW step), the hooked pass and the float32 pass (the two passes
of a reproduced half-precision incident), as medians and as multiples of that step. ``--threads 1`` makes CPU time
the work itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _models import GPT, SMALL  # noqa: E402

from lightning_nanguard import GradNormMonitor  # noqa: E402
from lightning_nanguard.engine import get_engine  # noqa: E402
from lightning_nanguard.forensics.replay import run_pass  # noqa: E402
from lightning_nanguard.testing import FaultInjector  # noqa: E402


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)


def _cpu_ms(fn: Any) -> float:
    """The process CPU time ``fn`` takes (ms): on a shared machine, far steadier than wall time."""
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1000.0


def _manual_step(trainer: pl.Trainer, model: GPT, batch: Any, opt: torch.optim.Optimizer) -> None:
    """One plain training step (forward, backward, optimizer step), as the Trainer runs it."""
    with trainer.precision_plugin.train_step_context():
        loss = model.training_step(batch, 0)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(precision: str, steps: int, fault_step: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT(SMALL, steps=steps)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,  # type: ignore[arg-type]
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
        callbacks=[FaultInjector("loss", steps=[fault_step]), GradNormMonitor(forensics="every"), timer],
    )
    trainer.fit(model)
    [incident] = get_engine(trainer).sink.records
    replay_ms = float(incident.diagnosis["replay_ms"])
    fit_step_ms = statistics.median(t for i, t in enumerate(timer.times) if i not in (0, fault_step)) * 1000.0
    # Interleaved, so that a busy machine slows the step and the passes alike: step, hooked pass, float32 pass.
    batch = next(iter(model.train_dataloader()))
    model.log = lambda *a, **k: None  # type: ignore[method-assign]  # outside a fit: nothing to log into
    opt = torch.optim.AdamW(model.parameters(), lr=1e-9)
    stub = SimpleNamespace(precision_plugin=trainer.precision_plugin)
    step, hooked, fp32 = [], [], []
    for _ in range(rounds):
        step.append(_cpu_ms(lambda: _manual_step(trainer, model, batch, opt)))
        hooked.append(_cpu_ms(lambda: run_pass(stub, model, batch, 0, float32=False)))  # type: ignore[arg-type]
        fp32.append(_cpu_ms(lambda: run_pass(stub, model, batch, 0, float32=True)))  # type: ignore[arg-type]
    return {
        "fit_step_ms": fit_step_ms,
        "incident_replay_ms": replay_ms,
        "step_ms": statistics.median(step),
        "hooked_ms": statistics.median(hooked),
        "fp32_ms": statistics.median(fp32),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"model {SMALL.name}: {SMALL}, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(
        "| precision | step in the fit, wall (ms) | incident replay_ms, wall (x that step) | step, CPU (ms) "
        "| hooked pass, CPU (x step) | float32 pass, CPU (x step) |"
    )
    print("|---|---|---|---|---|---|")
    for precision in args.precision:
        r = measure(precision, args.steps, fault_step=args.steps // 2, rounds=args.rounds)
        s = r["step_ms"]
        print(
            f"| {precision} | {r['fit_step_ms']:.0f} | {r['incident_replay_ms']:.0f} "
            f"({r['incident_replay_ms'] / r['fit_step_ms']:.2f}) | {s:.0f} | {r['hooked_ms']:.0f} "
            f"({r['hooked_ms'] / s:.2f}) | {r['fp32_ms']:.0f} ({r['fp32_ms'] / s:.2f}) |"
        )


if __name__ == "__main__":
    main()
