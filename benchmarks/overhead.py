"""Per-step overhead of GradNormMonitor vs plain Lightning, Lightning's grad_norm recipe and detect_anomaly.

Prints, side by side in one run, for a small GPT (4 layers, d256, ~4.2M params) and a deep one (24 layers, ~26M
params, 292 tensors):

* in-Trainer step-time ratios vs the plain-Lightning baseline (process CPU time, torch pinned to 1 thread, rounds
  with the variant order rotated; ratio = median over rounds of variant median / same-round baseline median);
* the isolated cost of the check itself on real gradients with a cold cache, and that cost divided by one read of
  all gradients at this machine's measured memory bandwidth (the floor);
* host reads per training step (``.item()``/``.tolist()``/``.numpy()``/``bool()``/``float()`` on a tensor, counted
  with ``lightning_nanguard.testing.HostReadCounter``; a dispatch mode would miss ``.tolist()``), minus the
  baseline's. The median step is reported: a logging step (every 50) may read more.

And one FSDP2 row: ``ModelParallelStrategy`` with ``fully_shard`` on 2 gloo CPU ranks (an MLP of 8 layers x 256 in 9
``fully_shard`` units, 527k parameters, batch 32 per rank, AdamW): plain vs GradNormMonitor vs the whole preset
(``default_callbacks()``), side by side in one run of 2 processes (wall time per step on rank 0, rounds with the variant
order rotated; ratio = median over rounds of variant median / same-round plain median). The ranks run in a child
process (``--fsdp2-worker``), since Lightning launches rank 1 by re-running the command.

Run: ``python benchmarks/overhead.py`` (about 6 minutes on 2 cores) or ``--quick`` (about 1.5 minutes, noisier);
``--fsdp2-only`` for the FSDP2 row alone (about 1 minute), ``--no-fsdp2`` without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import DEEP, GPT, SMALL, GPTConfig

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.signals.gradients import ParamIndex, grad_norms
from lightning_nanguard.testing import HostReadCounter


class StepTimer(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks = warmup, []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marks.append(time.process_time())

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marks.append(time.process_time())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)][self.warmup :]


class LightningGradNormRecipe(pl.Callback):
    """What Lightning's docs recommend since track_grad_norm was removed: log grad_norm(...) every step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class StepHostReads(pl.Callback):
    """Host reads per step, from one ``on_train_batch_start`` to the next (the last step: to ``on_train_end``).

    Put it first in the callback list, so the other callbacks' batch-start hooks count towards their step.
    """

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._counter: HostReadCounter | None = None
        self._mark = 0

    def on_train_batch_start(self, *args: Any) -> None:
        if self._counter is None:
            self._counter = HostReadCounter().__enter__()
        else:
            self.per_step.append(self._counter.count - self._mark)
        self._mark = self._counter.count

    def on_train_end(self, *args: Any) -> None:
        self._close(record=True)

    def teardown(self, *args: Any, **kwargs: Any) -> None:  # a failed fit never reaches on_train_end
        self._close(record=False)

    def _close(self, record: bool) -> None:
        if self._counter is not None:
            if record:
                self.per_step.append(self._counter.count - self._mark)
            self._counter.__exit__(None, None, None)
            self._counter = None


VARIANTS: dict[str, Callable[[], tuple[list[pl.Callback], dict[str, Any]]]] = {
    "baseline": lambda: ([], {}),
    "GradNormMonitor()": lambda: ([GradNormMonitor()], {}),
    "grad_norm+log_dict": lambda: ([LightningGradNormRecipe()], {}),
    "detect_anomaly": lambda: ([], {"detect_anomaly": True}),
}


def _trainer(steps: int, callbacks: list[pl.Callback], tmp: str, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=tmp,
        logger=pl.loggers.TensorBoardLogger(tmp, name="bench"),
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def in_trainer(
    cfg: GPTConfig, rounds: int, warmup: int, timed: int, tmp: str
) -> dict[str, tuple[float, float, float, float]]:
    names = list(VARIANTS)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    medians: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        this_round: dict[str, float] = {}
        for name in order:
            callbacks, kw = VARIANTS[name]()
            timer = StepTimer(warmup)
            torch.manual_seed(0)
            model = GPT(cfg, steps=warmup + timed + 1)
            _trainer(warmup + timed, [*callbacks, timer], tmp, **kw).fit(model)
            this_round[name] = statistics.median(timer.step_times())
        for name in names:
            medians[name].append(this_round[name])
            ratios[name].append(this_round[name] / this_round["baseline"])
    return {
        n: (statistics.median(medians[n]) * 1e3, statistics.median(ratios[n]), min(ratios[n]), max(ratios[n]))
        for n in names
    }


def host_reads(cfg: GPTConfig, tmp: str, steps: int = 4) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, make in VARIANTS.items():
        callbacks, kw = make()
        counter = StepHostReads()
        torch.manual_seed(0)
        _trainer(steps, [counter, *callbacks], tmp, **kw).fit(GPT(cfg, steps=steps + 1))
        out[name] = statistics.median(counter.per_step[1:])
    return out


def isolated(cfg: GPTConfig, reps: int = 25) -> dict[str, float]:
    """Hook cost on real gradients vs the floor: one cold-cache read of the same bytes, interleaved rep by rep."""
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = next(iter(model.train_dataloader()))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1)).backward()
    params = list(model.parameters())
    index = ParamIndex(params, [n for n, _ in model.named_parameters()], depth=1)
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])  # the same bytes, one buffer
    scratch = torch.empty(16 * 1024 * 1024)  # 64 MiB written before each rep: nothing is cache-hot

    loss = logits.detach().float().mean()

    def ours() -> None:  # the healthy host-path work of the engine's sensor: one fused pass, one stack, one read
        norms = grad_norms(index)
        assert norms is not None
        torch.stack([norms.total, loss.reshape(())]).tolist()

    def lightning_recipe() -> None:
        grad_norm(model, norm_type=2)

    def floor() -> None:
        flat.sum()

    grads = [p.grad for p in params if p.grad is not None]

    def kernel() -> None:  # the fused norm kernel alone: what is left once our own Python is taken out
        torch._foreach_norm(grads, 2)

    fns = {"GradNormMonitor()": ours, "kernel": kernel, "grad_norm+log_dict": lightning_recipe, "floor": floor}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            scratch.fill_(1.0)
            t = time.process_time()
            fn()
            times[name].append(time.process_time() - t)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for name in ("GradNormMonitor()", "kernel"):
        out[f"x_floor:{name}"] = statistics.median(o / f for o, f in zip(times[name], times["floor"], strict=True))
    out["grad_mib"] = flat.numel() * flat.element_size() / 2**20
    out["tensors"] = float(len(params))
    return out


class WallTimer(pl.Callback):
    """Wall time per step (the ranks wait for each other in the collectives, so process time would miss that)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks = warmup, []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marks.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marks.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)][self.warmup :]


class ShardedMLP(pl.LightningModule):
    """8 Linear(256, 256) + GELU and a head, each Linear and the root ``fully_shard``-ed (9 units, 527k parameters)."""

    def __init__(self, steps: int, batch: int = 32, width: int = 256, depth: int = 8) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(width, 10)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(steps * batch * 2, width, generator=g)  # 2 ranks: each sees steps batches
        self.y = torch.randint(0, 10, (steps * batch * 2,), generator=g)
        self.batch = batch

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]  # type: ignore[index]
        for layer in self.body:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(self.x, self.y)
        return torch.utils.data.DataLoader(data, batch_size=self.batch, shuffle=False)


def _fsdp2_variants() -> dict[str, Callable[[], list[pl.Callback]]]:
    from lightning_nanguard import default_callbacks

    return {
        "plain ModelParallelStrategy": list,
        "GradNormMonitor()": lambda: [GradNormMonitor()],
        "suite (default_callbacks())": lambda: default_callbacks(),
    }


def fsdp2_worker(out: str, rounds: int, warmup: int, timed: int) -> None:
    """Both ranks run every variant, in the same order (each a fresh Trainer.fit in the same processes)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    variants = _fsdp2_variants()
    names = list(variants)
    medians: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    rank = 0
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        this_round: dict[str, float] = {}
        for name in order:
            timer = WallTimer(warmup)
            torch.manual_seed(0)
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=2,
                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                max_steps=warmup + timed,
                callbacks=[*variants[name](), timer],
                logger=False,
                log_every_n_steps=50,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            )
            trainer.fit(ShardedMLP(steps=warmup + timed + 1))
            rank = trainer.global_rank
            this_round[name] = statistics.median(timer.step_times())
        for name in names:
            medians[name].append(this_round[name])
            ratios[name].append(this_round[name] / this_round[names[0]])
    if rank == 0:
        result = {
            n: [statistics.median(medians[n]) * 1e3, statistics.median(ratios[n]), min(ratios[n]), max(ratios[n])]
            for n in names
        }
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"rounds": rounds, "timed": timed, "variants": result}, f)


def fsdp2_row(tmp: str, rounds: int, timed: int) -> dict[str, Any]:
    """Run ``fsdp2_worker`` on 2 ranks in a child process; its result."""
    out = os.path.join(tmp, "fsdp2.json")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    cmd = [sys.executable, os.path.abspath(__file__), "--fsdp2-worker", out, "--rounds", str(rounds)]
    subprocess.run([*cmd, "--timed", str(timed)], check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
    return result


def _print_fsdp2(row: dict[str, Any]) -> None:
    print(
        f"\nFSDP2 (ModelParallelStrategy + fully_shard), 2 gloo CPU ranks, MLP 8x256 (527k params, 9 units), batch 32 "
        f"per rank, AdamW; wall time per step on rank 0, {row['rounds']} rounds x {row['timed']} timed steps"
    )
    print("| variant | step ms | ratio vs plain [min-max] |")
    print("|---|---|---|")
    for name, (ms, ratio, low, high) in row["variants"].items():
        print(f"| {name} | {ms:.1f} | {ratio:.3f} [{low:.3f}-{high:.3f}] |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 6 timed steps (noisier)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timed", type=int, default=10)
    parser.add_argument("--isolated-only", action="store_true", help="only the isolated hook cost (about 1 minute)")
    parser.add_argument("--fsdp2-only", action="store_true", help="only the FSDP2 row (2 CPU ranks, about 1 minute)")
    parser.add_argument("--no-fsdp2", action="store_true", help="without the FSDP2 row")
    parser.add_argument("--fsdp2-worker", metavar="OUT", help=argparse.SUPPRESS)  # internal: one rank of the row
    args = parser.parse_args()
    rounds, timed = (2, 6) if args.quick else (args.rounds, args.timed)
    torch.set_num_threads(1)
    import logging
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.fsdp2_worker:
        fsdp2_worker(args.fsdp2_worker, args.rounds, warmup=20, timed=args.timed)
        return
    # The FSDP2 row's steps are ~10x shorter than the GPTs': 10x the timed steps for the same noise.
    fsdp2_timed = 10 * timed
    if args.fsdp2_only:
        with tempfile.TemporaryDirectory() as tmp:
            print("measuring FSDP2 (2 ranks) ...", file=sys.stderr, flush=True)
            _print_fsdp2(fsdp2_row(tmp, rounds, fsdp2_timed))
        return
    fsdp2: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_fsdp2:
            print("measuring FSDP2 (2 ranks) ...", file=sys.stderr, flush=True)
            fsdp2 = fsdp2_row(tmp, rounds, fsdp2_timed)
        results = {}
        for cfg in (SMALL, DEEP):
            print(f"measuring {cfg.name} ...", file=sys.stderr, flush=True)
            if args.isolated_only:
                results[cfg.name] = ({}, isolated(cfg), {})
            else:
                results[cfg.name] = (in_trainer(cfg, rounds, 2, timed, tmp), isolated(cfg), host_reads(cfg, tmp))
    small, deep = results[SMALL.name], results[DEEP.name]
    if not args.isolated_only:
        _print_in_trainer(small, deep, rounds, timed)
    _print_isolated(results)
    if fsdp2 is not None:
        _print_fsdp2(fsdp2)


def _print_in_trainer(small: Any, deep: Any, rounds: int, timed: int) -> None:
    print(f"\nCPU process time, 1 thread, {rounds} rounds x {timed} timed steps (ratio: median [min-max] vs baseline)")
    header = (
        f"| variant | {SMALL.name}: step ms | ratio | {DEEP.name}: step ms | ratio | host reads/step (small; deep) |"
    )
    print(header)
    print("|" + "---|" * 6)
    for name in VARIANTS:
        s, d = small[0][name], deep[0][name]
        hs = small[2][name] - small[2]["baseline"]
        hd = deep[2][name] - deep[2]["baseline"]
        print(
            f"| {name} | {s[0]:.1f} | {s[1]:.3f} [{s[2]:.3f}-{s[3]:.3f}] | {d[0]:.1f} | {d[1]:.3f} [{d[2]:.3f}-{d[3]:.3f}]"
            f" | +{hs:.0f}; +{hd:.0f} |"
        )


def _print_isolated(results: dict[str, Any]) -> None:
    print(
        "\nIsolated check on real gradients, cold cache, interleaved (ms, medians; x floor = median per-rep ratio to "
        "one cold read of the same bytes)"
    )
    print(
        "| model | grads MiB | tensors | floor ms | GradNormMonitor ms | x floor | % of step | _foreach_norm alone x floor "
        "| grad_norm recipe ms |"
    )
    print("|" + "---|" * 9)
    for cfg in (SMALL, DEEP):
        in_tr, iso, _ = results[cfg.name]
        ours = iso["GradNormMonitor()"]
        step = in_tr["baseline"][0] if in_tr else float("nan")
        print(
            f"| {cfg.name} | {iso['grad_mib']:.1f} | {iso['tensors']:.0f} | {iso['floor']:.2f} | {ours:.2f} | "
            f"{iso['x_floor:GradNormMonitor()']:.2f}x | {100 * ours / step:.2f}% | {iso['x_floor:kernel']:.2f}x | "
            f"{iso['grad_norm+log_dict']:.2f} |"
        )


if __name__ == "__main__":
    main()
