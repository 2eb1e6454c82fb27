"""What PrecisionHeadroom costs on the mid-size CPU GPTs of ``overhead.py`` (4 layers d256; 24 layers d288).

Three figures per model, under ``32-true`` (the probe's work is the same in every precision: hooks, one fused
reduction, one copy; ``--half`` adds ``16-mixed``, whose float16 matmuls torch emulates on a CPU, about 17x slower
than float32 there, which makes the ratio look smaller than it is on a GPU):

* **sample**: the extra process time of one sampled step, isolated: a forward + backward with the probe armed (a
  forward hook on every submodule keeping its output), the fused reduction, under ``16-mixed`` the loss-scaled
  gradient's reduction (the largest parameter gradient times the scale, ``signals.headroom.scaled_grad_amax``), the
  all-reduce (one rank: none) and the host-mirror copy, minus the same forward + backward without (interleaved reps,
  medians); **of which gradient**: that gradient reduction alone;
* **tick**: the extra time of an unsampled step: the callback's batch-start hook (one comparison) timed on a real
  Trainer, plus Lightning's dispatch of one hook (about 2 µs; a Trainer-level ratio cannot resolve microseconds on a
  step of hundreds of milliseconds);
* **amortized**: (sample / every_n_steps + tick) as a share of the baseline step, for ``every_n_steps=50`` (the
  preset) and 10.

And the host reads of a fit with the callback minus without (``HostReadCounter``, the optimizer's own left out; must
be 0).

Run: ``python benchmarks/headroom.py`` (about 5 minutes on 2 quiet cores) or ``--quick``.
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
from lightning_nanguard.signals.headroom import OutputProbe, scaled_grad_amax, watched_modules
from lightning_nanguard.testing import HostReadCounter


def _step(model: GPT, x: torch.Tensor, y: torch.Tensor, half: bool) -> None:
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        loss = model.training_step((x, y), 0)
    loss.backward()
    model.zero_grad(set_to_none=True)


def sample_cost(cfg: GPTConfig, half: bool, reps: int) -> tuple[float, float, float, int]:
    """(plain step ms, sampled step's extra ms, of which the loss-scaled gradient's reduction (16-mixed), modules
    watched), process time, interleaved reps."""
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = next(iter(model.train_dataloader()))
    probe = OutputProbe(watched_modules(model))
    mirror = HostMirror(len(probe.names) + 2, torch.device("cpu"))
    scale = torch.full((), 65536.0)
    plain: list[float] = []
    sampled: list[float] = []
    gradient: list[float] = []
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
        loss.backward()
        if half:  # 16-mixed: the loss-scaled gradient's two entries join the vector, in on_before_optimizer_step
            g = time.process_time()
            amax = scaled_grad_amax([p.grad for p in model.parameters() if p.grad is not None], scale)
            assert amax is not None
            full = torch.cat([full, torch.stack([amax, scale])])
            gradient.append(time.process_time() - g)
        mirror.fill(full)
        model.zero_grad(set_to_none=True)
        mirror.values(full.numel())
        sampled.append(time.process_time() - t)
    base = statistics.median(plain)
    grad_ms = statistics.median(gradient) * 1e3 if gradient else 0.0
    return base * 1e3, (statistics.median(sampled) - base) * 1e3, grad_ms, len(probe.names)


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


def tick_cost(cfg: GPTConfig, tmp: str, calls: int = 20000) -> float:
    """µs per unsampled step: the callback's batch-start hook (between samples: one comparison) called on the
    Trainer of a short fit, plus Lightning's dispatch of one hook to one callback (about 2 µs, docs/PERFORMANCE.md,
    measured with the suite's host benchmark)."""
    callback = PrecisionHeadroom(every_n_steps=10**9)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[callback],
        default_root_dir=tmp,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPT(cfg, steps=3)
    trainer.fit(model)
    callback.watch.probe = OutputProbe(watched_modules(model))  # as during the fit, with no sample due
    callback.watch._due = 10**9
    hook = callback.on_train_batch_start
    t = time.perf_counter()
    for _ in range(calls):
        hook(trainer, model, None, 0)
    return (time.perf_counter() - t) / calls * 1e6 + LIGHTNING_DISPATCH_US


LIGHTNING_DISPATCH_US = 2.0


class _OptimizerReadsUncounted(pl.Callback):
    """Pauses ``reads`` inside ``optimizer.step``: AdamW reads each tensor's step count (``item()``) on every step it
    takes, so a fit in which the GradScaler drops fewer steps (the scale lowered ahead of an overflow) would show
    the optimizer's own reads as the callback's."""

    def __init__(self, reads: HostReadCounter) -> None:
        self.reads = reads

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            step = optimizer.step

            def paused(*args: Any, _step: Any = step, **kwargs: Any) -> Any:
                self.reads.paused = True
                try:
                    return _step(*args, **kwargs)
                finally:
                    self.reads.paused = False

            optimizer.step = paused  # type: ignore[method-assign]


def extra_reads(cfg: GPTConfig, half: bool, tmp: str, steps: int = 12) -> int:
    """Host reads of a whole fit with ``PrecisionHeadroom(every_n_steps=4)`` minus without (FP32Evaluation in both:
    the end-of-fit state check both then make), the optimizer's own reads left out."""
    counts = []
    for callbacks in ([FP32Evaluation()], [FP32Evaluation(), PrecisionHeadroom(every_n_steps=4)]):
        with HostReadCounter() as reads:
            _fit(cfg, half, [*callbacks, _OptimizerReadsUncounted(reads)], steps, tmp)
        counts.append(reads.count)
    return counts[1] - counts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--half", action="store_true", help="also 16-mixed (slow on a CPU)")
    args = parser.parse_args()
    reps = 6 if args.quick else 15
    torch.set_num_threads(1)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(
        "| model | precision | modules | step ms | sample: extra ms | of which gradient ms | tick µs "
        "| amortized, every 50 | every 10 | extra host reads per fit |"
    )
    print("|" + "---|" * 10)
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in (SMALL, DEEP):
            for half in (False, True) if args.half else (False,):
                print(f"measuring {cfg.name} {'16-mixed' if half else '32-true'} ...", file=sys.stderr, flush=True)
                step, extra, grad_ms, modules = sample_cost(cfg, half, reps)
                tick_us = tick_cost(cfg, tmp)
                reads = extra_reads(cfg, half, tmp)
                tick = tick_us / 1e3
                every = {n: 100 * (extra / n + tick) / step for n in (50, 10)}
                print(
                    f"| {cfg.name} | {'16-mixed' if half else '32-true'} | {modules} | {step:.1f} | {extra:.2f} "
                    f"({100 * extra / step:.1f}%) | {f'{grad_ms:.2f}' if half else '-'} | {tick_us:.1f} | {every[50]:.2f}% | "
                    f"{every[10]:.2f}% | {reads} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
