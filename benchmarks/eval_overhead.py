"""What FP32Evaluation costs: evaluation time with mode="always" and mode="on_nonfinite" vs plain half-precision eval.

A small GPT (4 layers, d256, 4 heads, seq 128, batch 16, ~4.2M params) is validated with ``trainer.validate`` in each
variant, side by side in one run, rotating the order each round. Time is **process CPU time** with torch pinned to one
thread (wall time on a shared box is meaningless), per evaluation batch between ``on_validation_batch_start`` and
``on_validation_batch_end`` (the step and everything the callback adds around it), median over the timed batches.
Ratio = median over rounds of (variant median / the same round's plain median), with [min-max] over rounds.

Variants, per precision:
  plain                 no callback (evaluation in the half dtype)
  always                FP32Evaluation("always")
  on_nonfinite healthy  FP32Evaluation("on_nonfinite"), no batch overflows: one host read per batch, no fp32 work
  on_nonfinite all bad  FP32Evaluation("on_nonfinite"), every batch overflows and is re-run in float32
  fp32 reference        no callback, Trainer(precision="32-true"): "always" should cost what this costs
  plain + metrics       no callback; the step updates three torchmetrics metrics (a mean, a sum and a per-class
                        accuracy over the vocabulary: states of 1, 1 and 4 x vocab elements)
  on_nonfinite healthy + metrics   the same under FP32Evaluation("on_nonfinite"): the metric states are copied
                        before every half-precision call (to be put back if the batch is re-run); compare with
                        "plain + metrics"

Run: ``PYTHONPATH=. python benchmarks/eval_overhead.py`` (about 1-2 minutes on 2 CPUs; ``--precisions
bf16-mixed,bf16-true`` doubles that). On a CPU without native bf16/fp16 (no AVX-512-BF16/AMX) half precision is
emulated and several times slower than float32, so "always" comes out *faster* than plain there; on a GPU or a
bf16-capable CPU expect "always" to cost roughly the float32/half speed ratio. The "on_nonfinite healthy" ratio is
the number that carries over: one host read per batch and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import GPT as SmallGPT
from _models import SMALL

from lightning_nanguard import FP32Evaluation

BATCH = 8  # evaluation batch; --batch-size changes it


class GPT(SmallGPT):
    """The benchmarks' small GPT. ``overflow=True`` makes every half-precision evaluation step non-finite."""

    def __init__(self, overflow: bool = False, metrics: bool = False) -> None:
        super().__init__(dataclasses.replace(SMALL, batch=BATCH))
        self.overflow = overflow
        self.metrics = metrics
        if metrics:
            self.mean_loss, self.tokens = MeanMetric(), SumMetric()
            self.accuracy = MulticlassAccuracy(num_classes=self.cfg.vocab, average="macro")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.cfg.vocab).float(), y.reshape(-1))
        if self.overflow and logits.dtype != torch.float32:
            loss = loss * float("inf")  # stands in for an fp16/bf16 overflow in the model
        if self.metrics:
            self.mean_loss.update(loss)
            self.tokens.update(torch.tensor(float(y.numel())))
            self.accuracy.update(logits.reshape(-1, self.cfg.vocab).float(), y.reshape(-1))
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, self.cfg.vocab, (64 * BATCH, self.cfg.seq + 1), generator=g)
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)


class BatchTimer(Callback):
    """Process CPU time from on_validation_batch_start to on_validation_batch_end (first in the callback list)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._start = time.process_time()

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.process_time() - self._start)


VARIANTS: dict[str, tuple[str | None, bool, bool]] = {  # (mode, every batch overflows, torchmetrics in the step)
    "plain": (None, False, False),
    "always": ("always", False, False),
    "on_nonfinite healthy": ("on_nonfinite", False, False),
    "on_nonfinite all bad": ("on_nonfinite", True, False),
    "fp32 reference": (None, False, False),  # the same evaluation under 32-true: what "always" should cost
    "plain + metrics": (None, False, True),
    "on_nonfinite healthy + metrics": ("on_nonfinite", False, True),
}


def run(precision: str, variant: str, batches: int, state: dict[str, torch.Tensor], root: str) -> float:
    mode, overflow, metrics = VARIANTS[variant]
    model = GPT(overflow=overflow, metrics=metrics)
    model.load_state_dict(state, strict=False)  # the metrics' states are not in it
    timer = BatchTimer()
    callbacks: list[Callback] = [timer] + ([FP32Evaluation(mode)] if mode else [])  # type: ignore[arg-type]
    trainer = pl.Trainer(
        default_root_dir=root,  # nanguard writes its incident log under the log dir
        accelerator="cpu",
        devices=1,
        precision="32-true" if variant == "fp32 reference" else precision,  # type: ignore[arg-type]
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=batches + 1,
    )
    trainer.validate(model, verbose=False)
    return statistics.median(timer.times[1:])  # the first batch warms up allocators and caches


def main() -> None:
    global BATCH
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2, help="timed evaluation batches per run (after 1 warm-up)")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--precisions", default="bf16-mixed", help="comma-separated, e.g. bf16-mixed,bf16-true")
    args = parser.parse_args()
    BATCH = args.batch_size
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(0)
    state = GPT().state_dict()
    n_params = sum(t.numel() for t in GPT().parameters())
    print(
        f"GPT {SMALL.layers} layers, d{SMALL.d}, seq {SMALL.seq}, batch {BATCH}: {n_params / 1e6:.2f}M params; CPU time, 1 thread"
    )
    names = list(VARIANTS)
    for precision in args.precisions.split(","):
        per_round: dict[str, list[float]] = {n: [] for n in names}
        ratios: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            with tempfile.TemporaryDirectory() as root:
                times = {n: run(precision, n, args.batches, state, root) for n in order}
            for n in names:
                per_round[n].append(times[n])
                ratios[n].append(times[n] / times["plain"])
        print(f"\n{precision}")
        print(f"{'variant':<31} {'ms/batch':>9} {'ratio':>7}  [min-max]")
        for n in names:
            ms = statistics.median(per_round[n]) * 1e3
            rs = ratios[n]
            print(f"{n:<31} {ms:9.1f} {statistics.median(rs):7.3f}  [{min(rs):.3f}-{max(rs):.3f}]")
        with_metrics = [a / b for a, b in zip(per_round[names[-1]], per_round["plain + metrics"], strict=True)]
        extra = statistics.median(
            a - b for a, b in zip(per_round[names[-1]], per_round["plain + metrics"], strict=True)
        )
        print(
            f"{names[-1]} / plain + metrics: {statistics.median(with_metrics):.3f} "
            f"[{min(with_metrics):.3f}-{max(with_metrics):.3f}], {extra * 1e3:+.2f} ms/batch"
        )


if __name__ == "__main__":
    main()
