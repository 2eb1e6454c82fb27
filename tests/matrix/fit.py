"""The run of one case: the model of its kind (``kinds.py``), the buffer fault, each rank's dump, the Trainer."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_nanguard import default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.matrix.kinds import MatrixModel, averaging_callbacks
from tests.matrix.spec import CALLBACK_NAMES, STEPS, Case

__all__ = ["BufferFault", "MatrixModel", "RankDump", "build_trainer", "callbacks_for"]


def _batchnorm(module: nn.Module) -> nn.BatchNorm1d:
    return next(m for m in module.modules() if isinstance(m, nn.BatchNorm1d))


class BufferFault(pl.Callback):
    """The "buffer" site: element 0 of the BatchNorm's ``running_mean`` becomes ``value`` (or is multiplied by a
    finite one) at the start of the chosen optimizer steps, on the chosen ranks: the state a bad batch leaves behind
    in a buffer no gradient check sees. ``injected`` mirrors ``FaultInjector.injected``."""

    def __init__(self, steps: list[int], value: float | str, ranks: list[int] | None) -> None:
        self.steps = set(steps)
        self.value = float(value)
        self.ranks = None if ranks is None else set(ranks)
        self.injected: list[tuple[int, str, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step not in self.steps:
            return
        if self.ranks is not None and trainer.global_rank not in self.ranks:
            return
        bn = _batchnorm(pl_module)
        assert bn.running_mean is not None
        with torch.no_grad():
            if math.isfinite(self.value):
                bn.running_mean.mul_(self.value)
            else:
                bn.running_mean[0] = self.value
        self.injected.append((trainer.global_step, "buffer", trainer.global_rank))


class RankDump(pl.Callback):
    """Each rank writes ``rank{r}.pt``: its parameters and buffers, the step, the faults it injected and the incidents
    it holds; after every batch (the state an error leaves) and at the end (``final``)."""

    def __init__(self, out_dir: str, injector: Any) -> None:
        self.out_dir = out_dir
        self.injector = injector

    def _dump(self, trainer: pl.Trainer, pl_module: pl.LightningModule, final: bool) -> None:
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        data = {
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "final": final,
            "state": state,
            "params": [n for n, _ in pl_module.named_parameters()],
            "injected": list(self.injector.injected),
            "incidents": [i.to_dict() for i in get_engine(trainer).sink.records],
        }
        path = os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt")
        torch.save(data, path + ".tmp")
        os.replace(path + ".tmp", path)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._dump(trainer, pl_module, final=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dump(trainer, pl_module, final=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After the suite's teardown (listed after it): the state fit returns, whatever a callback's on_train_end or
        # on_fit_end wrote and the end-of-fit check's second pass restored.
        if stage == "fit":
            self._dump(trainer, pl_module, final=True)


def _precision(precision: str) -> dict[str, Any]:
    if precision == "16-mixed":  # a real fp16 autocast with a real GradScaler, on CPU
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))]}
    return {"precision": precision}


def _suite(callbacks: str) -> list[pl.Callback]:
    if callbacks == "suite":
        return default_callbacks()
    return default_callbacks(**{name: name == callbacks for name in CALLBACK_NAMES})


def _injector(case: Case) -> Any:
    steps = case.fault_steps
    if case.optimization == "manual-2opt":  # global_step counts both optimizers' steps: 2 per batch
        steps = [2 * s for s in steps]
    if case.site == "buffer":
        return BufferFault(steps, case.injector_value, case.fault_ranks)
    return FaultInjector(case.site, steps=steps, value=case.injector_value, ranks=case.fault_ranks)  # type: ignore[arg-type]


def build_trainer(case: Case, workdir: str, callbacks: list[pl.Callback]) -> pl.Trainer:
    steps = STEPS * (2 if case.optimization == "manual-2opt" else 1)
    kw: dict[str, Any] = {
        "default_root_dir": workdir,
        "accelerator": "cpu",
        "devices": 2 if case.ddp else 1,
        "max_steps": steps,
        "max_epochs": -1,
        "logger": CSVLogger(workdir, name="log", version=0),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "deterministic": True,
        "callbacks": callbacks,
        **_precision(case.precision),
    }
    if case.ddp:
        kw["strategy"] = "ddp_spawn"
    if case.optimization == "accumulation":
        kw["accumulate_grad_batches"] = 2
    return pl.Trainer(**kw)


def callbacks_for(case: Case, workdir: str) -> tuple[Any, list[pl.Callback]]:
    """(the fault injector, every callback of the run): the injector first, so that its fault lands before any
    nanguard hook of the same stage; the ``ema``/``swa`` kinds' averaging callback after the suite; the rank dump;
    checkpoints every 4 steps, all kept."""
    injector = _injector(case)
    checkpointing = ModelCheckpoint(dirpath=os.path.join(workdir, "ckpt"), every_n_train_steps=4, save_top_k=-1)
    dump = RankDump(os.path.join(workdir, "ranks"), injector)
    return injector, [injector, *_suite(case.callbacks), *averaging_callbacks(case.model), dump, checkpointing]
