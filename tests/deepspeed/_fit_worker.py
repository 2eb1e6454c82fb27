"""Real ``Trainer.fit`` runs under DeepSpeedStrategy on CPU (one rank, gloo): ``python -m tests.deepspeed._fit_worker
<out.json> [--gpu] [scenario ...]`` runs the scenarios in one process (DeepSpeed's import costs seconds) and writes, per
scenario, what the test checks.

Lightning's DeepSpeedStrategy refuses anything but CUDA in ``setup_environment``; ``CPUDeepSpeedStrategy`` bypasses
exactly that check (and the CUDA device-index checks next to it). DeepSpeed itself runs on its CPU accelerator
(``DS_ACCELERATOR=cpu``); its fp16 is allowed only where oneDNN reports fp16 support, which the worker forces on (the
tiny models here run fp16 fine on any x86 CPU through torch's own kernels), and it skips compiling DeepSpeed's optional shared-memory all-reduce op. ``tests/deepspeed/test_deepspeed.py``
runs the same callbacks on CUDA with the real strategy, unpatched, where a GPU exists.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from typing import Any

# Before anything imports DeepSpeed, which picks its accelerator once.
if "--gpu" in sys.argv:
    os.environ.pop("DS_ACCELERATOR", None)
else:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor, LossScaleWatchdog
from lightning_nanguard.engine import get_engine


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy on CPU: only Lightning's CUDA checks are bypassed, DeepSpeed runs unchanged."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)  # DeepSpeed reads its index as the device rank

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


def prepare_cpu() -> None:
    """DeepSpeed on this CPU: fp16 allowed, and no C++ shared-memory all-reduce op, which DeepSpeed's CPU backend
    would compile on first use (minutes on a fresh machine; an optimization that one rank never uses)."""
    import importlib

    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True  # type: ignore[method-assign]
    # By module name: the package attribute ``deepspeed.comm.torch`` is the torch library itself.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class Capture(Logger):
    """Every logged scalar, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def values(self, key: str) -> list[float]:
        return [m[key] for _, m in self.rows if key in m]


class Model(LightningModule):
    """A linear model; ``poison``: ``"always"`` makes every loss overflow fp16, ``"nan_at_3"`` makes step 3's NaN."""

    def __init__(self, poison: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.poison = poison
        self.ds_norms: list[float | None] = []
        self.ds_applied: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.layer(x).float() - y.float()) ** 2).mean()
        if self.poison == "always" or (self.poison == "rank1_always" and self.global_rank == 1):
            loss = loss * 1e30  # inf in fp16 at any loss scale: every step overflows
        elif self.poison == "nan_at_3" and self.global_step == 3:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = self.trainer.strategy.model
        norm = engine.get_global_grad_norm()
        self.ds_norms.append(None if norm is None else float(norm))
        self.ds_applied.append(bool(engine.was_step_applied()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


GPU = False  # --gpu: the real DeepSpeedStrategy on one CUDA device, nothing bypassed


def fit(
    model: Model, callbacks: list[Any], precision: str, steps: int, devices: int = 1, **strategy: Any
) -> dict[str, Any]:
    logger = Capture()
    if GPU:
        chosen: DeepSpeedStrategy = DeepSpeedStrategy(stage=2, **strategy)
    else:
        chosen = CPUDeepSpeedStrategy(stage=2, process_group_backend="gloo", **strategy)
    trainer = Trainer(
        accelerator="gpu" if GPU else "cpu",
        devices=devices,
        strategy=chosen,
        precision=precision,
        callbacks=callbacks,
        max_steps=steps,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    error = ""
    try:
        trainer.fit(model)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    incidents = [
        {
            "trigger": i.trigger,
            "action": i.action,
            "step": i.step,
            "message": i.message,
            "values": i.values,
            "ranks": i.ranks,
            "repeats": i.repeats,
        }
        for i in get_engine(trainer).sink.records
    ]
    ds = trainer.strategy.model
    scaler = getattr(getattr(ds, "optimizer", None), "loss_scaler", None)
    return {
        "rank": int(trainer.global_rank),
        "error": error,
        "incidents": incidents,
        "loss_scale": logger.values("nanguard/loss_scale"),
        "overflow_steps": logger.values("nanguard/overflow_steps"),
        "grad_norm": logger.values("nanguard/grad_norm"),
        "grad_norm_max": logger.values("nanguard/grad_norm_max"),
        "skipped_steps": logger.values("nanguard/skipped_steps"),
        "ds_skipped_steps": int(ds.skipped_steps),
        "ds_norms": model.ds_norms,
        "ds_applied": model.ds_applied,
        "raise_error_at_min_scale": getattr(scaler, "raise_error_at_min_scale", None),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def scenario(name: str) -> dict[str, Any]:
    # Lightning's DeepSpeedStrategy defaults: min_loss_scale=1, hysteresis=2; a small initial scale gets to the
    # floor in a few steps.
    collapse_strategy = {"initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 1}
    if name == "collapse_stops":
        watchdog = LossScaleWatchdog(min_scale=1.0, floor_patience=3, max_overflow_streak=None, on_collapse="auto")
        return fit(Model("always"), [watchdog], "16-mixed", 12, **collapse_strategy)
    if name == "floor_above_deepspeed":
        watchdog = LossScaleWatchdog(min_scale=2.0, floor_patience=2, max_overflow_streak=None, on_collapse="warn")
        return fit(Model("always"), [watchdog], "16-mixed", 6, **collapse_strategy)
    if name == "exit_explained":
        watchdog = LossScaleWatchdog(floor_patience=None, max_overflow_streak=None)
        return fit(Model("always"), [watchdog], "16-mixed", 12, **collapse_strategy)
    if name == "fp16_skips_counted":
        return fit(Model(), [GradNormMonitor(), LossScaleWatchdog()], "16-mixed", 10, initial_scale_power=18)
    if name == "two_ranks":  # only rank 1 overflows: DeepSpeed's reduced flag makes both ranks decide alike
        watchdog = LossScaleWatchdog(min_scale=1.0, floor_patience=3, max_overflow_streak=None)
        return fit(Model("rank1_always"), [watchdog, GradNormMonitor()], "16-mixed", 12, devices=2, **collapse_strategy)
    if name == "bf16_check_forced":
        return fit(Model("nan_at_3"), [GradNormMonitor()], "bf16-mixed", 6)
    raise ValueError(name)


def main() -> None:
    global GPU
    args = sys.argv[1:]
    GPU = "--gpu" in args
    out, *names = [a for a in args if a != "--gpu"]
    if not GPU:
        prepare_cpu()
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = scenario(name)
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # two_ranks: Lightning relaunches this module as rank 1
    with open(out if rank == 0 else f"{out}.rank{rank}", "w", encoding="utf-8") as f:
        json.dump(results, f, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))


if __name__ == "__main__":
    main()
