"""What CheckpointGuard adds to a checkpoint save and load (plain python; prints a table; not a test).

Compares Lightning's TorchCheckpointIO with VerifyingCheckpointIO wrapping it, on a checkpoint of ``--params``
float32 weights plus AdamW-like state (2 moments), written to ``--dir`` (default: a temporary directory).
Also times the parts of the guarded save: the fused finiteness check, and hashing + fsync of the written file.
Wall-clock medians of ``--reps`` repetitions; run it on an otherwise idle machine for numbers worth quoting.

    python benchmarks/checkpoint_guard.py --params 5_000_000 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_nanguard._files import hash_file
from lightning_nanguard.checkpointing.verify import nonfinite_tensors
from lightning_nanguard.checkpointing.verifying_io import VerifyingCheckpointIO


def make_checkpoint(n_params: int, n_tensors: int = 100) -> dict[str, object]:
    size = max(1, n_params // n_tensors)
    weights = {f"layer{i}.weight": torch.randn(size) for i in range(n_tensors)}
    state = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(size), "exp_avg_sq": torch.rand(size)}
        for i in range(n_tensors)
    }
    return {"global_step": 10, "state_dict": weights, "optimizer_states": [{"state": state, "param_groups": []}]}


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=5_000_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ckpt = make_checkpoint(args.params)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        plain, guarded = TorchCheckpointIO(), VerifyingCheckpointIO(TorchCheckpointIO())
        p_plain, p_guard = os.path.join(d, "plain.ckpt"), os.path.join(d, "guarded.ckpt")
        rows = [
            ("save: TorchCheckpointIO", median_ms(lambda: plain.save_checkpoint(ckpt, p_plain), args.reps)),
            ("save: VerifyingCheckpointIO", median_ms(lambda: guarded.save_checkpoint(ckpt, p_guard), args.reps)),
            ("  part: fused finiteness check", median_ms(lambda: nonfinite_tensors(ckpt), args.reps)),
            ("  part: sha256 + fsync of the file", median_ms(lambda: hash_file(p_guard, fsync=True), args.reps)),
            (
                "load: TorchCheckpointIO",
                median_ms(lambda: plain.load_checkpoint(p_plain, weights_only=True), args.reps),
            ),
            ("load: VerifyingCheckpointIO", median_ms(lambda: guarded.load_checkpoint(p_guard), args.reps)),
        ]
        size_mib = os.path.getsize(p_guard) / 2**20
    print(f"checkpoint: {args.params / 1e6:.1f}M params + 2 Adam moments = {size_mib:.0f} MiB, {args.reps} reps")
    print(f"{'operation':40s} {'median ms':>10s}")
    for name, ms in rows:
        print(f"{name:40s} {ms:10.1f}")


if __name__ == "__main__":
    main()
