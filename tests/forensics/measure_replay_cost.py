"""Replay cost on the incident path, measured on the benchmarks' small GPT (not a test: run it by hand).

    python tests/forensics/measure_replay_cost.py [--steps 12] [--precision 32-true bf16-mixed]

For each precision: the median wall time of a healthy training step (batch start to batch end), the replay cost the
incident records (``diagnosis.replay_ms``: a ``FaultInjector`` loss fault that does not reproduce, so one hooked
pass), and the two passes of a reproduced half-precision incident timed directly (hooked, then float32).
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


def measure(precision: str, steps: int, fault_step: int) -> dict[str, float]:
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
    healthy = [t for i, t in enumerate(timer.times) if i not in (0, fault_step)]
    step_ms = statistics.median(healthy) * 1000.0
    replay_ms = float(incident.diagnosis["replay_ms"])
    # The two passes of a reproduced incident, timed directly on the same weights and batch.
    batch = next(iter(model.train_dataloader()))
    stub = SimpleNamespace(precision_plugin=trainer.precision_plugin)
    hooked = [run_pass(stub, model, batch, 0, float32=False).ms for _ in range(3)]  # type: ignore[arg-type]
    fp32 = [run_pass(stub, model, batch, 0, float32=True).ms for _ in range(3)]  # type: ignore[arg-type]
    return {
        "step_ms": step_ms,
        "incident_replay_ms": replay_ms,
        "hooked_ms": statistics.median(hooked),
        "fp32_ms": statistics.median(fp32),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"model {SMALL.name}: {SMALL}, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(
        "| precision | healthy step (ms) | incident replay (ms) | x step | hooked pass | float32 pass | both, x step |"
    )
    print("|---|---|---|---|---|---|---|")
    for precision in args.precision:
        r = measure(precision, args.steps, fault_step=args.steps // 2)
        both = r["hooked_ms"] + r["fp32_ms"]
        print(
            f"| {precision} | {r['step_ms']:.1f} | {r['incident_replay_ms']:.1f} | "
            f"{r['incident_replay_ms'] / r['step_ms']:.2f} | {r['hooked_ms']:.1f} | {r['fp32_ms']:.1f} | "
            f"{both / r['step_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
