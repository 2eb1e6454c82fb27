"""What PrecisionHeadroom's per-op headroom costs on the mid-size CPU GPTs of ``overhead.py`` (4 layers d256; 24
layers d288), and its first-step trial.

* **sample (ops)**: the extra process time of one sampled step's op probe: a forward + backward with the
  ``OpProbe`` armed over the forward (a dispatch mode seeing every aten op, one ``aminmax`` per measured op, the
  module stack's pre/post hooks) and its reduction, minus the same forward + backward without (interleaved reps,
  medians). The output probe's and the loss-scaled gradient's share is ``benchmarks/headroom.py``'s;
* **amortized**: that extra time over ``every_n_steps`` (50, the preset; and 10) as a share of the step; an unsampled
  step runs no part of it (no hook, no mode, no device op: its cost is ``headroom.py``'s tick);
* **trial**: the first step's trial, once per fit: a traced ``training_step`` and its loss's parameter gradients
  (``torch.autograd.grad``), with the isolation around it (buffers on copies, RNG and modules' state put back),
  as a multiple of the step.

On a CPU torch emulates float16 matmuls (a ``16-mixed`` step of these GPTs takes 7-15 s), so ``--precision``
``bf16-mixed`` (the default: the op probe measures bfloat16 ops, the work it does on a ``16-mixed`` step's float16
ops) or ``32-true`` with every float32 op measured (``OpProbe(dtypes=(torch.float32,))``: an upper bound, every op of
the forward counted). ``16-mixed`` runs too, slowly.

Run: ``python benchmarks/op_headroom.py [--quick] [--precision bf16-mixed|32-true|16-mixed]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import DEEP, GPT, SMALL, GPTConfig

from lightning_nanguard.forensics.isolation import preserved_attributes, preserved_state, swapped
from lightning_nanguard.signals.headroom import watched_modules
from lightning_nanguard.signals.op_headroom import OpProbe

_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}


@contextlib.contextmanager
def _precision(name: str) -> Iterator[None]:
    dtype = _DTYPES[name]
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        yield


def _step(model: GPT, x: torch.Tensor, y: torch.Tensor, precision: str, probe: OpProbe | None) -> None:
    if probe is not None:
        probe.arm()
    with _precision(precision):
        loss = model.training_step((x, y), 0)
    if probe is not None:
        probe.disarm()
        assert probe.reduce() is not None
    loss.backward()
    model.zero_grad(set_to_none=True)


def _trial(model: GPT, x: torch.Tensor, y: torch.Tensor, precision: str, probe: OpProbe) -> None:
    """What ``recovery.first_step_trial`` does around the traced forward, with the gradient taken."""
    with preserved_attributes(model), preserved_state(model), swapped(model, float32=False):
        probe.arm()
        with _precision(precision):
            loss = model.training_step((x, y), 0)
        probe.disarm()
        probe.reduce()
        torch.autograd.grad(loss.float(), [p for p in model.parameters() if p.requires_grad], allow_unused=True)


def measure(cfg: GPTConfig, precision: str, reps: int) -> tuple[float, float, float, int, int]:
    """(step ms, sampled step's extra ms, trial ms, modules, ops measured per forward)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    model.log = lambda *a, **k: None  # type: ignore[method-assign]  # no Trainer here
    x, y = next(iter(model.train_dataloader()))
    dtypes = (torch.float32,) if _DTYPES[precision] is None else (torch.float16, torch.bfloat16)
    probe = OpProbe(watched_modules(model), dtypes=dtypes)
    for _ in range(2):
        _step(model, x, y, precision, None)
    probe.arm()
    with _precision(precision):
        model.training_step((x, y), 0)
    probe.disarm()
    ops = len(probe.reading.names)
    probe.reduce()
    plain, sampled, trial = [], [], []
    for _ in range(reps):
        t = time.process_time()
        _step(model, x, y, precision, None)
        plain.append(time.process_time() - t)
        t = time.process_time()
        _step(model, x, y, precision, probe)
        sampled.append(time.process_time() - t)
        t = time.process_time()
        _trial(model, x, y, precision, probe)
        trial.append(time.process_time() - t)
    base = statistics.median(plain)
    extra = statistics.median(sampled) - base
    return base * 1e3, extra * 1e3, statistics.median(trial) * 1e3, len(probe.names), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--precision", default="bf16-mixed", choices=sorted(_DTYPES))
    args = parser.parse_args()
    reps = 5 if args.quick else 11
    torch.set_num_threads(1)
    print(
        "| model | precision | modules | ops measured | step ms | sample (ops): extra ms | amortized, every 50 "
        "| every 10 | trial, once per fit: ms (x step) |"
    )
    print("|" + "---|" * 9)
    for cfg in (SMALL, DEEP):
        print(f"measuring {cfg.name} {args.precision} ...", file=sys.stderr, flush=True)
        step, extra, trial, modules, ops = measure(cfg, args.precision, reps)
        print(
            f"| {cfg.name} | {args.precision} | {modules} | {ops} | {step:.1f} | {extra:.2f} ({100 * extra / step:.1f}%)"
            f" | {100 * extra / 50 / step:.2f}% | {100 * extra / 10 / step:.2f}% | {trial:.1f} ({trial / step:.2f}x) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
