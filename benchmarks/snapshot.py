"""Snapshot / restore cost of AutoRollback's SnapshotRing on a deep GPT-like model (params + AdamW state).

Plain python, not a test:  ``PYTHONPATH=$PWD python benchmarks/snapshot.py [--reps 7]``

Times are process CPU time with torch on 1 thread (wall time on a shared box is meaningless, PERFORMANCE.md), median
over interleaved reps, each after writing 64 MiB so the state is not cache-hot. The reference is one contiguous
``copy_`` of the same number of bytes into a preallocated CPU buffer: the floor for any snapshot.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_nanguard.recovery.snapshot import SnapshotRing, model_tensors
from lightning_nanguard.signals.tensors import all_finite

STEP_MS_REFERENCE = 613.0  # PERFORMANCE.md: gpt_deep 32-true baseline step, CPU time, 1 thread, this box


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class DeepGPT(nn.Module):
    """24 layers, d=288, vocab 8192, seq 64: ~26M params in ~292 tensors (PERFORMANCE.md's gpt_deep shape)."""

    def __init__(self, layers: int = 24, d: int = 288, vocab: int = 8192, seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)


def _median_ms(fn: Callable[[], object], reps: int, scratch: torch.Tensor) -> list[float]:
    out = []
    for _ in range(reps):
        scratch.add_(1.0)  # evict the state from the caches
        t0 = time.process_time()
        fn()
        out.append((time.process_time() - t0) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--every-n-steps", type=int, nargs="*", default=[10, 25, 50, 100])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = DeepGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # creates exp_avg, exp_avg_sq, step for every parameter
    params = model_tensors(model)
    n_params = sum(p.numel() for p in model.parameters())
    ring = SnapshotRing(2)
    ring.take(model, [opt], step=0, log_step=0)  # allocate (first-touch page faults are not the steady state)
    snap = ring.take(model, [opt], step=1, log_step=1)
    nbytes = snap.nbytes()
    flat_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    scratch = torch.zeros(16 * 1024 * 1024)  # 64 MiB

    cases: dict[str, Callable[[], object]] = {
        "plain copy_ of the same bytes": lambda: flat_dst.copy_(flat_src),
        "take() (foreach copy into buffers)": lambda: ring.take(model, [opt], step=2, log_step=2),
        "param finiteness check (+1 host read)": lambda: bool(all_finite(params)),
        "take() + param check (AutoRollback)": lambda: (
            bool(all_finite(params)),
            ring.take(model, [opt], step=3, log_step=3),
        ),
        "restore() (foreach copy back)": lambda: ring.restore(ring.get(ring.steps()[-1]), model, [opt]),  # type: ignore[arg-type]
        "optimizer-state check at restore": lambda: bool(ring.state_finite(ring.get(ring.steps()[-1]))),  # type: ignore[arg-type]
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.reps):  # interleaved rounds, one rep each
        for name, fn in cases.items():
            samples[name] += _median_ms(fn, 1, scratch)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["plain copy_ of the same bytes"]

    print(
        f"model: {n_params / 1e6:.1f}M params in {len(list(model.parameters()))} tensors; "
        f"snapshot {nbytes / 2**20:.0f} MiB"
    )
    print(f"{'operation':42s} {'median ms':>10s} {'[min-max]':>16s} {'x plain copy':>13s}")
    for name, values in samples.items():
        span = f"[{min(values):.1f}-{max(values):.1f}]"
        print(f"{name:42s} {med[name]:10.1f} {span:>16s} {med[name] / base:13.2f}")
    per_snapshot = med["take() + param check (AutoRollback)"]
    print(f"\namortized per step vs a {STEP_MS_REFERENCE:.0f} ms step (PERFORMANCE.md gpt_deep reference):")
    for n in args.every_n_steps:
        print(
            f"  every_n_steps={n:<4d} {per_snapshot / n:6.2f} ms/step = "
            f"{100 * per_snapshot / n / STEP_MS_REFERENCE:.2f}%"
        )


if __name__ == "__main__":
    main()
