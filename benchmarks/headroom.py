"""What PrecisionHeadroom costs on the mid-size CPU GPTs of ``overhead.py`` (4 layers d256; 24 layers d288).

Three figures per model, under ``16-mixed`` (autocast float16 + the CPU GradScaler) and ``32-true``:

* **sample**: the extra process time of one sampled step, isolated: a forward + backward with the probe armed (a
  forward hook on every submodule keeping its output), the fused reduction, the all-reduce (one rank: none) and the
  host-mirror copy, minus the same forward + backward without (interleaved reps, medians);
* **tick**: the extra time of an unsampled step in the Trainer: ``PrecisionHeadroom(every_n_steps=10**9)`` (one
  sample at step 0, then only the batch-start comparison) against plain Lightning, process time, rounds with the
  order rotated (the ratio's noise is of the order of a percent: see the min-max);
* **amortized**: (sample / every_n_steps + tick) as a share of the baseline step, for ``every_n_steps=50`` (the
  preset) and 10.

And the host reads per step of a fit with the callback minus without (``HostReadCounter``; must be 0).

Run: ``python benchmarks/headroom.py`` (about 3 minutes on 2 cores) or ``--quick``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import DEEP, GPT, SMALL, GPTConfig

from lightning_nanguard import FP32Evaluation, PrecisionHeadroom
from lightning_nanguard.engine.reading import HostMirror
from lightning_nanguard.signals.headroom import OutputProbe, watched_modules
from lightning_nanguard.testing import HostReadCounter


def _step(model: GPT, x: torch.Tensor, y: torch.Tensor, half: bool) -> None:
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        loss = model.training_step((x, y), 0)
    loss.backward()
    model.zero_grad(set_to_none=True)


def sample_cost(cfg: GPTConfig, half: bool, reps: int) -> tuple[float, float, int]:
    """(plain step ms, sampled step's extra ms, modules watched), process time, interleaved reps."""
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = next(iter(model.train_dataloader()))
    probe = OutputProbe(watched_modules(model))
    mirror = HostMirror(len(probe.names), torch.device("cpu"))
    plain: list[float] = []
    sampled: list[float] = []
    for _ in range(2):
        _step(model, x, y, half)
    for _ in range(reps):
        t = time.process_time()
        _step(model, x, y, half)
        plain.append(time.process_time() - t)
        t = time.process_time()
        probe.arm()
        with torch.autocast("cpu", dtype=torch.float16, enabled=half):
            loss = model.training_step((x, y), 0)
        probe.disarm()
        reduced = probe.reduce()
        assert reduced is not None
        full = torch.full((len(probe.names),), -1.0)
        full[torch.tensor(reduced[1])] = reduced[0]
        mirror.fill(full)
        loss.backward()
        model.zero_grad(set_to_none=True)
        mirror.values(len(probe.names))
        sampled.append(time.process_time() - t)
    base = statistics.median(plain)
    return base * 1e3, (statistics.median(sampled) - base) * 1e3, len(probe.names)


class _Timer(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks = warmup, []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(time.process_time())

    def on_train_end(self, *args: Any) -> None:
        self.marks.append(time.process_time())

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)][self.warmup :]


def _fit(cfg: GPTConfig, half: bool, callbacks: list[pl.Callback], steps: int, tmp: str) -> None:
    kw: dict[str, Any] = (
        {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]} if half else {}
    )
    torch.manual_seed(0)
    pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=tmp,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    ).fit(GPT(cfg, steps=steps + 1))


def tick_ratio(cfg: GPTConfig, half: bool, rounds: int, timed: int, tmp: str) -> tuple[float, float, float]:
    """Median [min, max] over rounds of (step with the callback ticking) / (plain step)."""
    ratios = []
    for r in range(rounds):
        medians = {}
        for name in ["plain", "tick"] if r % 2 == 0 else ["tick", "plain"]:
            timer = _Timer(warmup=3)
            callbacks: list[pl.Callback] = [PrecisionHeadroom(every_n_steps=10**9)] if name == "tick" else []
            _fit(cfg, half, [*callbacks, timer], 3 + timed, tmp)
            medians[name] = statistics.median(timer.times())
        ratios.append(medians["tick"] / medians["plain"])
    return statistics.median(ratios), min(ratios), max(ratios)


def extra_reads(cfg: GPTConfig, half: bool, tmp: str, steps: int = 12) -> int:
    """Host reads of a whole fit with ``PrecisionHeadroom(every_n_steps=4)`` minus without (FP32Evaluation in both:
    the end-of-fit state check both then make)."""
    counts = []
    for callbacks in ([FP32Evaluation()], [FP32Evaluation(), PrecisionHeadroom(every_n_steps=4)]):
        with HostReadCounter() as reads:
            _fit(cfg, half, callbacks, steps, tmp)
        counts.append(reads.count)
    return counts[1] - counts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    reps, rounds, timed = (6, 2, 6) if args.quick else (15, 4, 10)
    torch.set_num_threads(1)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(
        "| model | precision | modules | step ms | sample: extra ms | tick: ratio [min-max] | amortized, every 50 "
        "| every 10 | extra host reads per fit |"
    )
    print("|" + "---|" * 9)
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in (SMALL, DEEP):
            for half in (True, False):
                print(f"measuring {cfg.name} {'16-mixed' if half else '32-true'} ...", file=sys.stderr, flush=True)
                step, extra, modules = sample_cost(cfg, half, reps)
                ratio, low, high = tick_ratio(cfg, half, rounds, timed, tmp)
                reads = extra_reads(cfg, half, tmp)
                tick = max(ratio - 1.0, 0.0) * step
                every = {n: 100 * (extra / n + tick) / step for n in (50, 10)}
                print(
                    f"| {cfg.name} | {'16-mixed' if half else '32-true'} | {modules} | {step:.1f} | {extra:.2f} "
                    f"({100 * extra / step:.1f}%) | {ratio:.3f} [{low:.3f}-{high:.3f}] | {every[50]:.2f}% | "
                    f"{every[10]:.2f}% | {reads} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
