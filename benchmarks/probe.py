"""What one scoring of the probe batch costs (at each snapshot and each spike), against one training step.

Plain python, not a test:  ``PYTHONPATH=$PWD python benchmarks/probe.py [--reps 9]``

Process CPU time with torch on 1 thread (wall time on a shared box is meaningless, PERFORMANCE.md), median over
interleaved reps, on the two GPTs of ``_models.py``: a training step (forward, backward, AdamW step on one batch),
one ``ProbeBatch.score`` (the LightningModule's own ``training_step`` under ``no_grad`` on a private copy of the
probe's rows, RNG seeded and restored, buffers on copies, logging muted, the module's reachable state walked and put
back, every write into a tensor it reaches copied first), and the second scoring a spike adds (the reference
snapshot's weights loaded into the module, scored, the current ones put back: ``recovery.probe_weights``). A healthy
step costs the probe nothing: it is scored only at snapshots and spikes.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch

from benchmarks._models import DEEP, GPT, SMALL
from lightning_nanguard.recovery.probe import PROBE_ROWS, ProbeBatch
from lightning_nanguard.recovery.probe_weights import snapshot_weights
from lightning_nanguard.recovery.snapshot import SnapshotRing


def _ms(fn: object, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()  # type: ignore[operator]
        out.append((time.process_time() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    print(
        "| model | batch | probe rows | training step (ms) | probe scoring (ms) | scoring / step "
        "| spike: snapshot's weights scored (ms) | spike / step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cfg in (SMALL, DEEP):
        torch.manual_seed(0)
        module = GPT(cfg)
        opt = module.configure_optimizers()
        batch = next(iter(module.train_dataloader()))

        def step(module: GPT = module, opt: torch.optim.Optimizer = opt, batch: object = batch) -> None:
            opt.zero_grad(set_to_none=True)
            module.training_step(batch, 0).backward()  # self.log warns without a Trainer: silenced above
            opt.step()

        probe = ProbeBatch()
        probe.capture(batch, module, None)
        step()  # lazy state (AdamW moments) allocated before timing
        step_ms = _ms(step, args.reps)
        probe_ms = _ms(lambda probe=probe, module=module: probe.score(trainer, module), args.reps)
        ring = SnapshotRing(1)
        ring.take(module, [opt], step=0, log_step=0)
        step()  # the weights move on from the snapshot's

        def reference(probe: ProbeBatch = probe, module: GPT = module, ring: SnapshotRing = ring) -> None:
            with snapshot_weights(ring, 0, trainer, module) as loaded:
                assert loaded
                probe.score(trainer, module)

        ref_ms = _ms(reference, args.reps)
        rows = min(PROBE_ROWS, cfg.batch)
        spike = probe_ms + ref_ms
        print(
            f"| {cfg.name} | {cfg.batch} | {rows} | {step_ms:.1f} | {probe_ms:.1f} | {probe_ms / step_ms:.2f}x "
            f"| {ref_ms:.1f} | {spike / step_ms:.2f}x |"
        )


if __name__ == "__main__":
    main()
