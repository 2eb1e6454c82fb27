"""corrupt-resume: the newest checkpoint of an earlier run holds NaN weights; an older verified one sits next to it."""

from __future__ import annotations

import logging
import math
import os
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor

from lightning_nanguard.callbacks import CheckpointGuard
from lightning_nanguard.demo.common import DemoModule, TensorDataModule
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression

GOOD_EPOCHS = 2  # the earlier run: two good epochs with verified checkpoints


def _module(seed: int) -> DemoModule:
    return DemoModule(mlp(16, seed=seed), lr=3e-3)


def _fit(
    epochs: int,
    callbacks: list[Callback],
    module: DemoModule,
    data: TensorDataModule,
    ckpt_path: str | None = None,
    weights_only: bool | None = None,
) -> None:
    pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=epochs,
        callbacks=callbacks,
    ).fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=weights_only)


def _earlier_run(seed: int, ckpt_dir: str) -> str:
    """Write the earlier run's checkpoints; return the good one (the bad one is ``last.ckpt``)."""
    x, y, xv, yv = teacher_regression(seed + 6, 512, 16)
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the earlier run's own output (its summary) is not the demo's
    try:
        return _earlier_fits(seed, ckpt_dir, x, y, xv, yv)
    finally:
        lightning_log.setLevel(level)  # the demo's run prints its nanguard summary as usual


def _earlier_fits(seed: int, ckpt_dir: str, x: Tensor, y: Tensor, xv: Tensor, yv: Tensor) -> str:
    good = ModelCheckpoint(dirpath=ckpt_dir, filename="good-{epoch}", save_top_k=-1)
    # Two healthy epochs, saved through CheckpointGuard: verified files with checksum sidecars.
    _fit(
        GOOD_EPOCHS,
        [good, CheckpointGuard()],
        _module(seed),
        TensorDataModule((x, y), (xv, yv), batch_size=32),
    )
    good_path = os.path.join(ckpt_dir, f"good-epoch={GOOD_EPOCHS - 1}.ckpt")
    # It went on, unguarded, over a corrupt record: the weights went NaN and save_last wrote them.
    x_bad = x.clone()
    x_bad[300, 3] = math.nan
    last = ModelCheckpoint(dirpath=ckpt_dir, filename="later-{epoch}", save_last=True, save_top_k=0)
    with warnings.catch_warnings():  # "callbacks used to create the checkpoint ...": CheckpointGuard, on purpose
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint.*")
        _fit(
            GOOD_EPOCHS + 1,
            [last],
            _module(seed),
            TensorDataModule((x_bad, y), (xv, yv), batch_size=32),
            ckpt_path=good_path,
            weights_only=True,
        )
    return good_path


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    ckpt_dir = os.path.join(work_dir, "checkpoints")
    good = _earlier_run(seed, ckpt_dir)
    x, y, xv, yv = teacher_regression(seed + 6, 512, 16)
    resume = good if healthy else os.path.join(ckpt_dir, "last.ckpt")
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="resumed-{epoch}", save_top_k=-1)
    return Built(
        _module(seed),
        TensorDataModule((x, y), (xv, yv), batch_size=32),
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]},
        fit_kwargs={"ckpt_path": resume, "weights_only": True},
    )


TASK = register_task(
    Task(
        name="corrupt-resume",
        description="resume (ckpt_path=last.ckpt) from an earlier run whose last save holds NaN weights (a corrupt "
        "record poisoned it); the verified epoch-1 checkpoint sits in the same directory (fp32)",
        failure="every step after the resume is NaN: the loss, the gradients, the weights",
        causes=("corrupt_checkpoint",),
        precision="32-true",
        max_epochs=5,
        build=build,
    )
)
