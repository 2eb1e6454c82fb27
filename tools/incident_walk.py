"""Count the package files an incident walks: a NaN input row, detected, quarantined and reported.

A real fit with ``default_callbacks()`` on a tiny regression whose dataset holds one row of NaN (sample 37; batches
of 8 in order, so the batch of step 4). Every Python function call and return is seen with ``sys.setprofile``, from
the first ``on_train_batch_start`` of a step to the last ``on_train_batch_end`` of it. Two counts:

* **the walk** (what a reader follows from the fault to the record): the package files on the call stack at each
  milestone of the incident: *detected* (``FitLedger.account`` returns the event), *diagnosed* (the evidence rule
  returns the ``Diagnosis``), *decided* (``plan_remedy``), *quarantined* (``Quarantine.add``), *reported*
  (``IncidentSink.record``);
* **every file run**: the package files a function of which ran during the bad step and not during the healthy step
  before it (what every step runs is not the incident's): the helpers too (the replay's, the findings', the record's).

Run: ``python tools/incident_walk.py`` (a few seconds). ``--all`` lists the files of both counts with their functions.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import warnings
from collections import defaultdict
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_nanguard as ng

PACKAGE = os.path.dirname(ng.__file__)
BAD_ROW, BATCH, BAD_STEP = 37, 8, 37 // 8
# (file, function, profile event) -> milestone; a "return" counts where it returns something (the event).
MILESTONES = {
    ("engine/accounting.py", "account", "return"): "detected",
    ("policies/remedy.py", "plan_remedy", "call"): "decided",
    ("recovery/quarantine.py", "add", "call"): "quarantined",
    ("engine/sink.py", "record", "call"): "reported",
}
ORDER = ("detected", "diagnosed", "decided", "quarantined", "reported")


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = x.sum(dim=1, keepdim=True)
        x[BAD_ROW] = float("nan")  # the user's bad record
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Walk:
    """The files (and functions) of the package that ran, per traced step."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = steps
        self.ran: dict[int, dict[str, set[str]]] = {s: defaultdict(set) for s in steps}
        self.milestones: dict[str, list[str]] = {}  # milestone -> the package frames on the stack, outermost first
        self._step: int | None = None

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if self._step is None:
            return
        path = frame.f_code.co_filename
        if not path.startswith(PACKAGE):
            return
        rel, name = os.path.relpath(path, PACKAGE), frame.f_code.co_name
        if event == "call":
            self.ran[self._step][rel].add(name)
        if self._step != self.steps[-1]:
            return
        milestone = MILESTONES.get((rel, name, event))
        if rel.startswith("policies/rules/") and event == "return" and type(arg).__name__ == "Diagnosis":
            milestone = "diagnosed"
        if milestone is not None and (event == "call" or arg is not None):
            stack = []
            at: FrameType | None = frame
            while at is not None:
                if at.f_code.co_filename.startswith(PACKAGE):
                    stack.append(f"{os.path.relpath(at.f_code.co_filename, PACKAGE)}:{at.f_code.co_name}")
                at = at.f_back
            self.milestones.setdefault(milestone, stack[::-1])

    def start(self, step: int) -> None:
        if step in self.steps:
            self._step = step
            sys.setprofile(self._profile)

    def stop(self) -> None:
        if self._step is not None:
            sys.setprofile(None)
            self._step = None


class Start(pl.Callback):
    def __init__(self, walk: Walk) -> None:
        self.walk = walk

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.walk.start(trainer.global_step)


class Stop(pl.Callback):
    def __init__(self, walk: Walk) -> None:
        self.walk = walk

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.walk.stop()


def measure() -> tuple[list[Any], dict[str, list[str]], dict[str, set[str]]]:
    """Run the fit: its records, the milestones' stacks, and every file the incident ran (with its functions)."""
    pl.seed_everything(0, verbose=False)
    walk = Walk((BAD_STEP - 1, BAD_STEP))
    callbacks = ng.default_callbacks()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            default_root_dir=tmp,
            max_steps=BAD_STEP + 2,
            callbacks=[Start(walk), *callbacks, Stop(walk)],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(Regression())
    from lightning_nanguard.engine import get_engine

    healthy, bad = walk.ran[BAD_STEP - 1], walk.ran[BAD_STEP]
    ran = {f: fns for f, fns in bad.items() if f not in healthy}
    return list(get_engine(trainer).sink.records), walk.milestones, ran


def walked_files(milestones: dict[str, list[str]]) -> list[str]:
    """The walk: the files on the milestones' stacks (``SystemExit`` where the incident did not reach one)."""
    missing = [m for m in ORDER if m not in milestones]
    if missing:
        raise SystemExit(f"the incident did not reach: {missing}")
    return sorted({frame.split(":")[0] for m in ORDER for frame in milestones[m]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="list every file the incident ran, with its functions")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_nanguard").setLevel(logging.ERROR)
    records, milestones, ran = measure()
    print("incidents:", [(r.step, str(r.trigger), str(r.cause), [str(a) for a in r.actions]) for r in records])
    walked = walked_files(milestones)
    print(f"the walk ({' -> '.join(ORDER)}): {len(walked)} files")
    for m in ORDER:
        print(f"  {m}: {' > '.join(milestones[m])}")
    print(f"every file run by the incident and not by the healthy step before it: {len(ran)} files")
    if args.all:
        for f in sorted(ran):
            print(f"  {f}: {', '.join(sorted(ran[f]))}")


if __name__ == "__main__":
    main()
