"""nanguard on one CUDA GPU: ms/step and CUDA syncs/step, the snapshot's cost per slot, a probe scoring's cost.

    PYTHONPATH=$PWD python benchmarks/gpu.py --out DIR        (about 4 minutes on one H100)
    PYTHONPATH=$PWD python benchmarks/gpu.py --smoke --out DIR (the code paths on the CPU, a tiny GPT: no figures)

What it measures, written to ``DIR/gpu_bench.json`` and ``DIR/gpu_bench.md`` after every part (a part that fails is
recorded and the rest still runs):

1. **Snapshot cost per slot** (``SnapshotRing`` alone, a GPT's parameters and fused-AdamW state): the one-time
   allocation (page-locked, exact size), a synchronous copy, the side-stream copy (time to queue it, time until its
   event completes), a restore; and the bytes the caching host allocator would have pinned (rounded to powers of two).
2. **The probe batch**: one scoring of AutoRollback's probe (``ProbeBatch.score``: the LightningModule's own
   ``training_step`` under ``no_grad`` on its rows, in bf16-mixed) against one training step (forward, backward, fused
   AdamW step), medians of interleaved reps, synchronized around each: the cost at each snapshot and each spike.
3. **Training steps** (Lightning fits, bf16-mixed unless the path says otherwise) on a GPT of ~125M and ~400M
   parameters: plain Lightning, ``GradNormMonitor``, the preset (``default_callbacks()``) with AutoRollback every 50
   and every 10 steps, the preset every 10 with the copy forced synchronous (the design before side-stream copies),
   Lightning's ``grad_norm`` recipe (logged from ``on_before_optimizer_step``), and ``PrecisionHeadroom`` alone
   sampling every step (``headroom1``, on the GradScaler path: one sample's cost); on three optimizer paths (fused
   AdamW, 16-mixed with the GradScaler, foreach AdamW). ms/step over ``--steps`` timed steps after ``--warmup``
   (the window holds a snapshot step of both cadences), median over ``--rounds`` interleaved rounds (every config
   once per round, the order rotated); the time from fit start to the first batch (the slots are allocated there);
   peak device memory.
4. **CUDA syncs per step**, counted with ``torch.cuda.set_sync_debug_mode("warn")`` over a short fit of each config
   (not timed: the debug mode slows the step).

A time budget (``--budget-s``) stops scheduling new fits when spent; the results say which are missing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import GPT, GPTConfig

import lightning_nanguard as ng
from lightning_nanguard.recovery.probe import PROBE_ROWS, ProbeBatch
from lightning_nanguard.recovery.snapshot import SnapshotRing

SIZES = {
    "gpt_125m": GPTConfig("gpt_125m", layers=12, d=768, heads=12, seq=512, batch=8, vocab=50304),
    "gpt_400m": GPTConfig("gpt_400m", layers=28, d=1024, heads=16, seq=512, batch=8, vocab=50304),
    "smoke": GPTConfig("smoke", layers=2, d=64, heads=4, seq=32, batch=4, vocab=512),
}
PATHS = {  # optimizer path -> (precision, AdamW keyword arguments)
    "fused": ("bf16-mixed", {"fused": True}),
    "gradscaler": ("16-mixed", {"foreach": True}),
    "foreach": ("bf16-mixed", {"foreach": True}),
}
SUITES = ["plain", "gradnorm", "preset50", "preset10", "preset10_sync", "recipe", "headroom1"]
# PrecisionHeadroom alone, sampling every step (every 50 in the preset): one sample's cost per step, on the 16-mixed
# GradScaler path only (its loss-scaled gradient and its loss-scale cut exist there).
_ONLY_ON = {"preset10_sync": "fused", "headroom1": "gradscaler"}
PLAN = {  # size -> [(path, suite)]: the 400M model on the fused path only, to keep the run within minutes
    "gpt_125m": [(p, s) for p in PATHS for s in SUITES if _ONLY_ON.get(s, p) == p],
    "gpt_400m": [("fused", s) for s in SUITES if _ONLY_ON.get(s, "fused") == "fused"],
    "smoke": [(p, s) for p in PATHS for s in SUITES if _ONLY_ON.get(s, p) == p],
}
CUDA = torch.cuda.is_available()


def log(msg: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class BenchGPT(GPT):
    def __init__(self, cfg: GPTConfig, opt_kw: dict[str, Any], steps: int) -> None:
        super().__init__(cfg, steps=steps)
        self.opt_kw = opt_kw

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, **self.opt_kw)


class GradNormRecipe(pl.Callback):
    """Lightning's documented recipe: ``self.log_dict(grad_norm(self, norm_type=2))`` before each optimizer step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class SynchronousCopy(pl.Callback):
    """After AutoRollback's train start: its snapshots copied synchronously (the design before side streams)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            side = getattr(getattr(cb, "ring", None), "_side", None)
            if side is not None:
                side.unwatch()
                cb.ring._side = None


class Timer(pl.Callback):
    """ms/step over batches [warmup, warmup + steps), synchronized at the window's ends only; the time from fit
    start to the first batch; peak device memory."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.ms: float | None = None
        self.setup_s = 0.0
        self._t0 = self._fit = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == 0:
            self.setup_s = time.perf_counter() - self._fit
        if i == self.warmup:
            _sync()
            self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        if i == self.warmup + self.steps - 1:
            _sync()
            self.ms = (time.perf_counter() - self._t0) * 1e3 / self.steps


class SyncCounter(pl.Callback):
    """CUDA syncs per step from the sync debug mode's warnings (recorded by the caller)."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        self.caught, self.marks = caught, []  # type: list[warnings.WarningMessage], list[int]

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(sum("synchroniz" in str(w.message) for w in self.caught))


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    """ms of ``fn()``, the device synchronized before and after."""
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _callbacks(suite: str) -> list[pl.Callback]:
    if suite == "plain":
        return []
    if suite == "gradnorm":
        return [ng.GradNormMonitor()]
    if suite == "recipe":
        return [GradNormRecipe()]
    if suite == "headroom1":
        return [ng.PrecisionHeadroom(every_n_steps=1)]
    every = 50 if suite == "preset50" else 10
    extra: list[pl.Callback] = [SynchronousCopy()] if suite.endswith("_sync") else []
    return [*ng.default_callbacks(AutoRollback={"every_n_steps": every}), *extra]


def _fit(model: BenchGPT, path: str, suite: str, steps: int, extra: list[pl.Callback], root: str) -> pl.Trainer:
    precision, _ = PATHS[path]
    trainer = pl.Trainer(
        accelerator="cuda" if CUDA else "cpu",
        devices=1,
        precision=precision if CUDA else "32-true",
        max_steps=steps,
        logger=CSVLogger(root, name=f"{path}-{suite}"),
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=[*_callbacks(suite), *extra],
    )
    trainer.fit(model)
    return trainer


# ---------------------------------------------------------------------------------------------------------------- 1
class OneProcess:
    """What ``SnapshotRing.prepare`` reads of a Trainer, for one process."""

    world_size, global_rank, strategy = 1, 0, None


def snapshot_costs(cfg: GPTConfig, reps: int) -> dict[str, Any]:
    device = "cuda" if CUDA else "cpu"
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    tensors = [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
    exact = sum(t.numel() * t.element_size() for t in tensors)
    rounded = sum(2 ** math.ceil(math.log2(max(1, t.numel() * t.element_size()))) for t in tensors)
    out: dict[str, Any] = {"params": params, "state_bytes": exact, "caching_allocator_pinned_bytes": rounded}

    ring = SnapshotRing(2, pin_memory=True)
    out["prepare_ms"] = _timed(lambda: ring.prepare(OneProcess(), model, [opt]))  # type: ignore[arg-type]
    out["slot_bytes"] = ring.slots[0].nbytes()
    out["pinned"] = bool(ring.slots[0].flat is not None and ring.slots[0].flat.is_pinned())
    queue, done, sync_copy, restore = [], [], [], []
    for r in range(reps):
        _sync()
        t0 = time.perf_counter()
        snap = ring.take(model, [opt], step=2 * r, log_step=0)
        queue.append((time.perf_counter() - t0) * 1e3)
        snap.wait()
        done.append((time.perf_counter() - t0) * 1e3)
        restore.append(_timed(lambda s=snap: ring.restore(s, model, [opt])))  # type: ignore[misc]
    side = ring._side
    ring._side = None  # synchronous copies into the same page-locked slots
    for r in range(reps):
        sync_copy.append(_timed(lambda r=r: ring.take(model, [opt], step=2 * r + 1, log_step=0)))  # type: ignore[misc]
    ring._side = side
    ring.clear()
    med = statistics.median
    out.update(
        take_sync_ms=med(sync_copy),
        take_async_queue_ms=med(queue),
        take_async_complete_ms=med(done),
        restore_ms=med(restore),
        copy_gb_per_s=(out["slot_bytes"] / 1e9) / (med(done) / 1e3) if med(done) > 0 else None,
    )
    return out  # the model, optimizer and ring are freed on return (the caller collects)


def probe_costs(cfg: GPTConfig, reps: int) -> dict[str, Any]:
    """One scoring of AutoRollback's probe batch (at each snapshot and each spike) against one training step, both in
    bf16-mixed (the training precision the probe is scored in), synchronized around each: medians."""
    device = "cuda" if CUDA else "cpu"
    precision = "bf16-mixed" if CUDA else "32-true"
    trainer = pl.Trainer(accelerator=device, devices=1, precision=precision, logger=False, enable_progress_bar=False)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=CUDA)
    x, y = (t.to(device) for t in next(iter(model.train_dataloader())))
    context = trainer.precision_plugin.train_step_context

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with context():
            loss = model.training_step((x, y), 0)  # self.log warns without a fit: silenced in main
        loss.backward()
        opt.step()

    probe = ProbeBatch()
    probe.capture((x, y), model, None)

    step()  # lazy state (AdamW moments) and kernels before timing
    probe.score(trainer, model)
    steps, scorings = [], []
    for _ in range(reps):  # interleaved
        steps.append(_timed(step))
        scorings.append(_timed(lambda: probe.score(trainer, model)))
    med = statistics.median
    return {
        "precision": precision,
        "batch": cfg.batch,
        "rows": min(PROBE_ROWS, cfg.batch),
        "step_ms": med(steps),
        "probe_ms": med(scorings),
        "ratio": med(scorings) / med(steps),
    }


# ---------------------------------------------------------------------------------------------------------------- 2
def step_times(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None], deadline: float) -> None:
    for size in args.sizes:
        cfg = SIZES[size]
        plan = PLAN[size]
        rows = results["steps"].setdefault(size, {})
        models = {
            path: BenchGPT(cfg, PATHS[path][1], steps=args.warmup + args.steps + 8) for path in {p for p, _ in plan}
        }
        for rnd in range(args.rounds):
            order = plan[rnd % len(plan) :] + plan[: rnd % len(plan)]
            for path, suite in order:
                key = f"{path}/{suite}"
                row = rows.setdefault(key, {"ms": [], "setup_s": [], "peak_gb": []})
                if time.perf_counter() > deadline:
                    row.setdefault("skipped", "time budget spent")
                    continue
                timer = Timer(args.warmup, args.steps)
                if CUDA:
                    torch.cuda.reset_peak_memory_stats()
                try:
                    with tempfile.TemporaryDirectory() as root:
                        _fit(models[path], path, suite, args.warmup + args.steps, [timer], root)
                except Exception as exc:  # one config failing must not lose the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    log(f"{size} {key} round {rnd}: FAILED {row['error']}")
                    traceback.print_exc()
                    continue
                row["ms"].append(timer.ms)
                row["setup_s"].append(timer.setup_s)
                row["peak_gb"].append(torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0)
                log(f"{size} {key} round {rnd}: {timer.ms:.2f} ms/step (setup {timer.setup_s:.2f} s)")
                gc.collect()
            save()
        del models
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------- 3
def sync_counts(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None], deadline: float) -> None:
    steps = 12
    for size in args.sizes:
        cfg = SIZES[size]
        rows = results["syncs"].setdefault(size, {})
        models: dict[str, BenchGPT] = {}
        for path, suite in PLAN[size]:
            if suite == "preset10_sync":
                continue
            key = f"{path}/{suite}"
            if time.perf_counter() > deadline:
                rows[key] = {"skipped": "time budget spent"}
                continue
            model = models.setdefault(path, BenchGPT(cfg, PATHS[path][1], steps=steps + 4))
            try:
                with warnings.catch_warnings(record=True) as caught, tempfile.TemporaryDirectory() as root:
                    warnings.simplefilter("always")
                    counter = SyncCounter(caught)
                    if CUDA:
                        torch.cuda.set_sync_debug_mode("warn")
                    try:
                        _fit(model, path, suite, steps, [counter], root)
                    finally:
                        if CUDA:
                            torch.cuda.set_sync_debug_mode(0)
            except Exception as exc:
                rows[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                log(f"syncs {size} {key}: FAILED {rows[key]['error']}")
                continue
            per_step = [b - a for a, b in zip(counter.marks, counter.marks[1:], strict=False)]
            healthy = per_step[2:]  # after the first steps (optimizer state created)
            rows[key] = {"per_step": per_step, "median": statistics.median(healthy) if healthy else None}
            log(f"syncs {size} {key}: {rows[key]['median']} per healthy step ({per_step})")
        save()
        del models
        gc.collect()


# ---------------------------------------------------------------------------------------------------------------- report
def _table(title: str, header: str, by_size: dict[str, Any], cells: Callable[[dict[str, Any]], str]) -> list[str]:
    """A section of one row per model size (``cells``: its columns after the first), or nothing when none ran."""
    if not by_size:
        return []
    lines = [f"## {title}", "", header, "|" + "---|" * (header.count("|") - 1)]
    for size, row in by_size.items():
        lines.append(f"| {size} | failed: {row['error'][:80]} |" if "error" in row else f"| {size} | {cells(row)} |")
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# nanguard on {results['device']}",
        "",
        f"torch {results['torch']}, lightning {results['lightning']}",
        "",
    ]
    lines += _table(
        "Snapshot cost per slot (parameters + fused AdamW state)",
        "| model | params | slot GB | pinned by caching allocator GB | allocate (once) ms | sync copy ms | "
        "side-stream: queue ms | side-stream: complete ms | GB/s | restore ms |",
        results.get("snapshot", {}),
        lambda s: (
            f"{s['params'] / 1e6:.0f}M | {s['slot_bytes'] / 1e9:.2f} | "
            f"{s['caching_allocator_pinned_bytes'] / 1e9:.2f} | {s['prepare_ms']:.0f} | {s['take_sync_ms']:.1f} | "
            f"{s['take_async_queue_ms']:.2f} | {s['take_async_complete_ms']:.1f} | "
            f"{s['copy_gb_per_s'] or 0:.1f} | {s['restore_ms']:.1f}"
        ),
    )
    lines += _table(
        "The probe batch: one scoring (at each snapshot and each spike) against one training step",
        "| model | precision | batch | probe rows | training step ms | probe scoring ms | scoring / step |",
        results.get("probe", {}),
        lambda p: (
            f"{p['precision']} | {p['batch']} | {p['rows']} | {p['step_ms']:.1f} | {p['probe_ms']:.2f} | "
            f"{p['ratio']:.3f}x"
        ),
    )
    for size, rows in results.get("steps", {}).items():
        lines += [
            f"## {size}: ms/step (median of rounds) and CUDA syncs per healthy step",
            "",
            "| path/suite | ms/step | x plain | rounds | setup s | peak GB | syncs/step |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, row in rows.items():
            ms = statistics.median(row["ms"]) if row.get("ms") else None
            plain = rows.get(f"{key.split('/')[0]}/plain", {}).get("ms")
            ratio = f"{ms / statistics.median(plain):.3f}" if ms and plain else ""
            syncs = results.get("syncs", {}).get(size, {}).get(key, {}).get("median", "")
            note = row.get("error", row.get("skipped", ""))
            shown = f"{ms:.2f}" if ms else note[:60]
            setup = f"{statistics.median(row['setup_s']):.2f}" if row.get("setup_s") else ""
            peak = f"{max(row['peak_gb']):.1f}" if row.get("peak_gb") else ""
            lines.append(f"| {key} | {shown} | {ratio} | {len(row.get('ms', []))} | {setup} | {peak} | {syncs} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def per_size(
    results: dict[str, Any],
    key: str,
    sizes: list[str],
    measure: Callable[[GPTConfig], dict[str, Any]],
    save: Callable[[], None],
) -> None:
    """``results[key][size] = measure(config)`` for each size (a failure recorded as its error), saved after each."""
    for size in sizes:
        try:
            results[key][size] = measure(SIZES[size])
            gc.collect()
            if CUDA:
                torch.cuda.empty_cache()
            log(f"{key} {size}: {results[key][size]}")
        except Exception as exc:
            results[key][size] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            traceback.print_exc()
        save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sizes", nargs="*", default=["gpt_125m", "gpt_400m"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=50)  # batches 6..55: a snapshot step of every 10 and every 50
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=270.0)
    parser.add_argument("--smoke", action="store_true", help="tiny GPT, few steps: the code paths, on any device")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.rounds, args.warmup, args.steps, args.reps = ["smoke"], 1, 2, 10, 1
    start = time.perf_counter()
    deadline = start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    torch.set_float32_matmul_precision("high")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "args": vars(args),
        "snapshot": {},
        "probe": {},
        "steps": {},
        "syncs": {},
    }

    def save() -> None:
        results["elapsed_s"] = time.perf_counter() - start
        with open(os.path.join(args.out, "gpu_bench.json"), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "gpu_bench.md"), "w", encoding="utf-8") as f:
            f.write(markdown(results))

    log(f"device {results['device']}; sizes {args.sizes}; budget {args.budget_s:.0f} s")
    per_size(results, "snapshot", args.sizes, lambda cfg: snapshot_costs(cfg, args.reps), save)
    per_size(results, "probe", args.sizes, lambda cfg: probe_costs(cfg, max(5, args.reps)), save)
    for part in (sync_counts, step_times):  # the counts are short: they are not the ones a spent budget cuts
        try:
            part(args, results, save, deadline)
        except Exception as exc:
            results.setdefault("errors", []).append(f"{part.__name__}: {type(exc).__name__}: {exc}"[:500])
            traceback.print_exc()
        save()
    log(f"done in {time.perf_counter() - start:.0f} s: {args.out}/gpu_bench.md")


if __name__ == "__main__":
    main()
