"""Per-step host cost of the nanguard callbacks on a tiny model, where a step is almost all Python (issue 14).

Lightning's ``BoringModel`` (one ``Linear(32, 2)``, batch size 1; SGD at lr 0.01 instead of its 0.1, at which its
regression diverges and the suite rightly intervenes: ``StableBoringModel``) on the CPU with
``torch.set_num_threads(1)``: a step costs a few hundred microseconds of host work, like a GPU user's millisecond
step, so whatever the callbacks add per step shows up undiluted. Variants, side by side in ONE process, in interleaved rounds (the order rotated
each round, so drift and warm-up hit every variant alike):

* ``plain``: Lightning alone;
* ``GradNormMonitor()`` alone, and with ``forensics="off"`` (healthy steps must cost the same: forensics runs on
  the incident path only);
* ``suite``: the six callbacks at their defaults: ``GradNormMonitor(), AutoRollback(), OptimizerBackoff(),
  LossScaleWatchdog(), CheckpointGuard(), FP32Evaluation()``;
* ``default_callbacks()``: only where the package has such a preset;
* reference rows (``--no-floor`` leaves them out): 1 and 6 ``Callback`` objects that override nothing, i.e. what
  Lightning's hook dispatch alone charges per installed callback (it enters a profiler context for every hook of
  every callback, overridden or not), a floor no callback can go below; and one callback that does nothing but the
  step check's own tensor work, written inline (the loss kept in ``on_before_backward``; in
  ``on_before_optimizer_step`` one ``torch._foreach_norm`` over the gradients, one ``stack`` with the loss and one
  ``.tolist()``; its other per-batch hooks hidden as nanguard's are): the floor of any per-step check that reads
  every gradient before the update, which is what GradNormMonitor adds its bookkeeping to.

A step's time is measured with ``time.perf_counter`` from one ``on_train_batch_start`` to the next (the first
``--warmup`` steps are dropped). Reported per variant: the median over rounds of the run's median µs/step; the µs/step
ADDED vs plain (median over rounds of the same-round difference; min-max over rounds); the ratio to plain (median
over rounds of the same-round ratio); and the mean µs/step (all timed steps: the logging steps every 50 and epoch
ends included), with its own same-round difference.

Then, host reads per healthy step (``lightning_nanguard.testing.HostReadCounter``: ``Tensor.item``/``tolist``/
``numpy``/``bool()``/``float()``/..., by anyone, nanguard's own pinned host buffers excepted), minus plain
Lightning's, per precision (``32-true``, ``bf16-mixed``, ``16-mixed`` with a CPU ``GradScaler``) and optimizer
(``BoringModel``'s SGD, ``AdamW(foreach=True)``, ``AdamW(fused=True)``). These runs use a ``CSVLogger`` so the
logging step's read shows in the mean.

Trainer: ``max_steps`` = ``--steps`` (400; ``--quick``: 100), ``log_every_n_steps=50``, no progress bar, no model
summary, no checkpointing, no logger (except in the host-read table), no validation.

Run: ``python benchmarks/host_overhead.py`` (about 3 minutes on an idle 2-core machine), ``--quick`` (under a minute,
noisier), ``--profile`` (adds a cProfile of the suite variant: top functions by cumulative and by own time, in
µs/step), ``--skip-reads`` / ``--reads-only``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_nanguard
from lightning_nanguard import GradNormMonitor
from lightning_nanguard.preset import CALLBACKS
from lightning_nanguard.testing import HostReadCounter

PLAIN = "plain Lightning"
SUITE = "suite (6 callbacks)"
FLOOR_1 = "reference: 1 empty Callback"
FLOOR_6 = "reference: 6 empty Callbacks"
FLOOR_OPS = "reference: the check's tensor ops alone"


def _suite() -> list[pl.Callback]:
    return [cls() for cls in CALLBACKS]


class EmptyCallback(pl.Callback):
    """Overrides nothing: what Lightning's hook dispatch alone costs per callback."""


class TensorOpsOnly(pl.Callback):
    """The per-step check's tensor work and nothing else (the ``FLOOR_OPS`` row): one fused norm pass over the
    gradients, one ``stack`` with the loss, one host read. Per-batch hooks it does not use are hidden from Lightning's
    dispatch, as nanguard's members do (``callbacks/_base.bind_hooks``)."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None
        self.params: list[torch.Tensor] = []
        self.values: list[float] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_nanguard.callbacks._base import _PER_BATCH_HOOKS

        for name in _PER_BATCH_HOOKS:  # Callback's own no-ops, hidden from Lightning's dispatch
            if getattr(type(self), name) is getattr(pl.Callback, name):
                setattr(self, name, None)
        self.params = [p for p in pl_module.parameters() if p.requires_grad]

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.loss = loss

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in self.params]
        assert self.loss is not None
        self.values = torch.stack([*torch._foreach_norm(grads, 2), self.loss]).tolist()  # type: ignore[arg-type]


def variants(floor: bool = False) -> dict[str, Callable[[], list[pl.Callback]]]:
    out: dict[str, Callable[[], list[pl.Callback]]] = {PLAIN: list}
    if floor:
        out[FLOOR_1] = lambda: [EmptyCallback()]
    out["GradNormMonitor()"] = lambda: [GradNormMonitor()]
    # Forensics runs on the incident path only: on healthy steps "off" and the default "first" must cost the same.
    out['GradNormMonitor(forensics="off")'] = lambda: [GradNormMonitor(forensics="off")]
    if floor:
        out[FLOOR_OPS] = lambda: [TensorOpsOnly()]
        out[FLOOR_6] = lambda: [EmptyCallback() for _ in range(6)]
    out[SUITE] = _suite
    preset = getattr(lightning_nanguard, "default_callbacks", None)
    if callable(preset):
        out["default_callbacks()"] = lambda: list(preset())
    return out


class StepClock(pl.Callback):
    """``perf_counter`` at every ``on_train_batch_start``; a step is the time to the next one."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.marks.append(time.perf_counter())

    def step_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)][warmup:]


class StepReads(pl.Callback):
    """Host reads per step: a ``HostReadCounter`` active from step ``warmup`` to the end of fit, sampled per step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.counter: HostReadCounter | None = None
        self.marks: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.counter is None and trainer.global_step >= self.warmup:
            self.counter = HostReadCounter().__enter__()
        if self.counter is not None:
            self.marks.append(self.counter.count)

    def on_train_end(self, *args: Any) -> None:
        if self.counter is not None:
            self.marks.append(self.counter.count)  # the last step ends here
            self.counter.__exit__(None, None, None)

    def teardown(self, *args: Any, **kwargs: Any) -> None:  # in case fit failed before on_train_end
        if self.counter is not None and self.counter._saved:
            self.counter.__exit__(None, None, None)

    def per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


class StableBoringModel(BoringModel):
    """``BoringModel`` with SGD at lr 0.01 instead of 0.1 (the same parameters, the same per-step host work).

    At lr 0.1 BoringModel's random regression diverges (the loss climbs from 0.56 to ~1e4 by step 50), so the suite
    rightly rolls back and backs the learning rate off at step 51, and every later step is a backed-off one, not a
    healthy one. At lr 0.01 no callback has anything to report over the run."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.01)


class AdamWModel(BoringModel):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self) -> Any:
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


OPTIMIZERS: dict[str, Callable[[], BoringModel]] = {
    "SGD (BoringModel)": BoringModel,
    "AdamW foreach": lambda: AdamWModel(fused=False),
    "AdamW fused": lambda: AdamWModel(fused=True),
}


def _precision(name: str) -> dict[str, Any]:
    if name == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    return {"precision": name}


def _trainer(steps: int, callbacks: Sequence[pl.Callback], root: str, logger: Any = False, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=list(callbacks),
        default_root_dir=root,
        logger=logger,
        log_every_n_steps=50,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def _fit(steps: int, callbacks: Sequence[pl.Callback], root: str, model: pl.LightningModule, **kw: Any) -> None:
    gc.collect()
    _trainer(steps, callbacks, root, **kw).fit(model)


def timing(steps: int, warmup: int, rounds: int, root: str, floor: bool) -> dict[str, dict[str, float]]:
    makers = variants(floor)
    names = list(makers)
    med: dict[str, list[float]] = {n: [] for n in names}
    mean: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            clock = StepClock()
            torch.manual_seed(0)
            _fit(steps, [clock, *makers[name]()], root, StableBoringModel())
            times = clock.step_times(warmup)
            med[name].append(statistics.median(times) * 1e6)
            mean[name].append(statistics.fmean(times) * 1e6)
        print(
            f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {med[n][-1]:.0f}" for n in names) + " µs/step (median)",
            file=sys.stderr,
            flush=True,
        )
    out: dict[str, dict[str, float]] = {}
    for n in names:
        added = [v - p for v, p in zip(med[n], med[PLAIN], strict=True)]
        ratio = [v / p for v, p in zip(med[n], med[PLAIN], strict=True)]
        added_mean = [v - p for v, p in zip(mean[n], mean[PLAIN], strict=True)]
        out[n] = {
            "median": statistics.median(med[n]),
            "added": statistics.median(added),
            "added_min": min(added),
            "added_max": max(added),
            "ratio": statistics.median(ratio),
            "mean": statistics.median(mean[n]),
            "added_mean": statistics.median(added_mean),
        }
    return out


def host_reads(
    steps: int, warmup: int, root: str, precisions: Sequence[str]
) -> dict[tuple[str, str], dict[str, tuple[float, float] | str]]:
    """(precision, optimizer) -> variant -> (median reads/step, mean reads/step), or the error text."""
    out: dict[tuple[str, str], dict[str, tuple[float, float] | str]] = {}
    for precision in precisions:
        for opt_name, make_model in OPTIMIZERS.items():
            row: dict[str, tuple[float, float] | str] = {}
            for name, make in variants().items():
                reads = StepReads(warmup)
                torch.manual_seed(0)
                try:
                    logger = CSVLogger(root, name="reads")
                    _fit(steps, [reads, *make()], root, make_model(), logger=logger, **_precision(precision))
                except Exception as err:  # e.g. a fused optimizer this torch build lacks on the CPU
                    row[name] = f"{type(err).__name__}: {err}"[:80]
                    continue
                per = reads.per_step()
                row[name] = (statistics.median(per), statistics.fmean(per))
            out[(precision, opt_name)] = row
            print(f"host reads: {precision}, {opt_name} done", file=sys.stderr, flush=True)
    return out


def profile_suite(steps: int, root: str, top: int) -> None:
    torch.manual_seed(0)
    trainer = _trainer(steps, _suite(), root)
    model = StableBoringModel()
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    trainer.fit(model)
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"\n### cProfile: suite, {steps} steps (profiler overhead inflates every number)\n")
    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((file, line, func, ncalls, tottime, cumtime))

    def short(file: str) -> str:
        for marker in ("lightning_nanguard/", "lightning/", "torch/"):
            if marker in file:
                return marker + file.split(marker, 1)[1]
        return os.path.basename(file)

    print(f"Top {top} nanguard functions by cumulative time (µs/step = cumulative / steps):\n")
    print("| function | file:line | calls/step | cum µs/step | own µs/step |")
    print("|---|---|---|---|---|")
    ours = [r for r in rows if "lightning_nanguard" in r[0]]
    for file, line, func, ncalls, tottime, cumtime in sorted(ours, key=lambda r: -r[5])[:top]:
        print(
            f"| {func} | {short(file)}:{line} | {ncalls / steps:.2f} | {cumtime / steps * 1e6:.1f} "
            f"| {tottime / steps * 1e6:.1f} |"
        )
    print(f"\nTop {top} functions anywhere by own time (total own time {total / steps * 1e6:.0f} µs/step):\n")
    print("| function | file:line | calls/step | own µs/step | cum µs/step |")
    print("|---|---|---|---|---|")
    for file, line, func, ncalls, tottime, cumtime in sorted(rows, key=lambda r: -r[4])[:top]:
        print(
            f"| {func} | {short(file)}:{line} | {ncalls / steps:.2f} | {tottime / steps * 1e6:.1f} "
            f"| {cumtime / steps * 1e6:.1f} |"
        )
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    print("\n<details><summary>pstats, cumulative</summary>\n\n```\n" + buf.getvalue().strip() + "\n```\n</details>")


def _machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"{model}, nproc {os.cpu_count()}, load average at start {load}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, lightning {version('lightning')}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


def _print_timing(res: dict[str, dict[str, float]], steps: int, warmup: int, rounds: int) -> None:
    print(
        f"\n### Per-step host time, BoringModel, CPU, 1 thread: {rounds} interleaved rounds x {steps} steps "
        f"({warmup} warm-up steps dropped)\n"
    )
    print("| variant | µs/step (median) | added µs/step [min-max over rounds] | ratio | mean µs/step | added (mean) |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        added = "—" if name == PLAIN else f"{r['added']:+.0f} [{r['added_min']:+.0f} … {r['added_max']:+.0f}]"
        added_mean = "—" if name == PLAIN else f"{r['added_mean']:+.0f}"
        print(f"| {name} | {r['median']:.0f} | {added} | {r['ratio']:.2f}x | {r['mean']:.0f} | {added_mean} |")


def _print_reads(res: dict[tuple[str, str], dict[str, tuple[float, float] | str]], steps: int, warmup: int) -> None:
    names = [n for n in variants() if n != PLAIN]
    print(
        f"\n### Host reads per healthy step, minus plain Lightning's ({steps} steps, counted from step {warmup}; "
        "median step, and in brackets the mean over all counted steps, logging steps included)\n"
    )
    print("| precision | optimizer | plain Lightning (absolute) | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for (precision, opt), row in res.items():
        plain = row[PLAIN]
        cells = []
        for n in names:
            v = row[n]
            if isinstance(v, str) or isinstance(plain, str):
                cells.append(f"error: {v if isinstance(v, str) else plain}")
            else:
                cells.append(f"{v[0] - plain[0]:+g} [{v[1] - plain[1]:+.2f}]")
        base = plain if isinstance(plain, str) else f"{plain[0]:g} [{plain[1]:.2f}]"
        print(f"| {precision} | {opt} | {base} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=20, help="steps dropped from the timing (default 20)")
    parser.add_argument("--quick", action="store_true", help="100 steps, 3 rounds, a shorter host-read run")
    parser.add_argument("--read-steps", type=int, default=120, help="steps per host-read run (default 120)")
    parser.add_argument("--precisions", default="32-true,bf16-mixed,16-mixed", help="for the host-read table")
    parser.add_argument("--skip-reads", action="store_true", help="timing only")
    parser.add_argument("--reads-only", action="store_true", help="host-read table only")
    parser.add_argument(
        "--no-floor", action="store_true", help="leave out the reference rows (1 and 6 callbacks that override nothing)"
    )
    parser.add_argument("--profile", action="store_true", help="also cProfile the suite variant")
    parser.add_argument("--profile-only", action="store_true", help="only the cProfile of the suite variant")
    parser.add_argument("--top", type=int, default=25, help="rows in the profile tables")
    args = parser.parse_args()
    steps, rounds, warmup, read_steps = args.steps, args.rounds, args.warmup, args.read_steps
    if args.quick:
        steps, rounds, warmup, read_steps = 100, 3, 10, 60

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_nanguard"):
        logging.getLogger(name).setLevel(logging.ERROR)

    print(f"Machine: {_machine()}\n")
    with tempfile.TemporaryDirectory() as root:
        if args.profile_only:
            profile_suite(steps, root, args.top)
            return
        if not args.reads_only:
            _print_timing(timing(steps, warmup, rounds, root, not args.no_floor), steps, warmup, rounds)
        if not args.skip_reads:
            precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
            reads = host_reads(read_steps, min(warmup, read_steps // 4), root, precisions)
            _print_reads(reads, read_steps, min(warmup, read_steps // 4))
        if args.profile:
            profile_suite(steps, root, args.top)


if __name__ == "__main__":
    main()
