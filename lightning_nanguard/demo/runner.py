"""Run one demo task under one configuration of callbacks and judge the outcome.

Example::

    >>> from lightning_nanguard.demo import preset, run_task
    >>> result = run_task("bad-data", preset(), seed=0, root_dir="lightning_logs", config="preset")
    >>> result.finished, result.incidents_by_cause
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_nanguard import _distributed
from lightning_nanguard.demo.common import probe_loss
from lightning_nanguard.demo.registry import get_task
from lightning_nanguard.engine import get_engine
from lightning_nanguard.engine.sink import INCIDENTS_FILE
from lightning_nanguard.exceptions import NanGuardError
from lightning_nanguard.recovery.backoff import lr_scale_of
from lightning_nanguard.reporting.incidents import Incident, IncidentLog

__all__ = ["RunResult", "run_task"]

# nanguard's documented run-time errors, by name: under ddp_spawn they reach the launcher as text only.
_NANGUARD_ERRORS = (
    "RecoveryBudgetExhausted",
    "NonFiniteTrainingError",
    "CheckpointVerificationError",
    "UnsupportedSetupError",
)


class _ReleaseProcessGroup(Callback):
    """Each rank of a multi-process demo run destroys the default process group at the very end of fit (teardown
    comes after every collective): Lightning leaves it up, and gloo's threads torn down with a spawned rank's
    interpreter can abort a rank whose fit succeeded ("terminate called without an active exception")."""

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _distributed.destroy_process_group()


@dataclass
class RunResult:
    """The outcome of one run.

    Attributes:
        task: the task name.
        config: the configuration's name (the TensorBoard run name).
        healthy: whether the fault was removed.
        seed: the seed.
        finished: fit returned, the final parameters and buffers are finite, and both losses are finite.
        error: ``"Type: message"`` of the exception that ended the run (``""`` when fit returned).
        train_loss: MSE of the final model on the training data with the fault removed (float32, eval mode).
        val_loss: the last validation loss the Trainer logged (the training precision, as the user sees it).
        incidents_by_cause: number of incidents per ``Incident.cause`` (``trigger`` when the cause is empty), repeats
            of a recurring one included.
        incidents: the incident records.
        skipped_steps: updates dropped by nanguard or the GradScaler, as nanguard counted them.
        rollbacks: incidents that rolled the state back (or restored damaged buffers alone).
        steps_rolled_back: optimizer steps of training the rollbacks undid (0 for buffers restored alone).
        lr_scale: OptimizerBackoff's learning-rate scale at the end (1.0 without it).
        wall_time: seconds in ``Trainer.fit``.
        log_dir: the TensorBoard run directory.
        steps: optimizer steps taken (``global_step``; ``-1`` under multi-process strategies, whose loops die with
            the worker processes).
    """

    task: str
    config: str
    healthy: bool
    seed: int
    finished: bool
    error: str
    train_loss: float
    val_loss: float
    incidents_by_cause: dict[str, int]
    incidents: list[Incident] = field(repr=False)
    skipped_steps: int
    rollbacks: int
    steps_rolled_back: int
    lr_scale: float
    wall_time: float
    log_dir: str
    steps: int

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["incidents"] = [i.to_dict() for i in self.incidents]
        return data

    def actions(self) -> list[tuple[str, list[str]]]:
        """``(cause, actions)`` of every incident, in order (what a report or a failing test shows)."""
        return [(i.cause or i.trigger, list(i.actions or [i.action])) for i in self.incidents]


def run_task(
    name: str,
    callbacks: list[Callback],
    *,
    seed: int = 0,
    root_dir: str,
    max_epochs: int | None = None,
    max_steps: int = -1,
    healthy: bool = False,
    config: str | None = None,
    devices: int = 1,
    strategy: str = "auto",
) -> RunResult:
    """Fit task ``name`` with ``callbacks`` and judge the outcome.

    Args:
        name: a registered task (``lightning_nanguard.demo.task_names()``).
        callbacks: the nanguard (or any) callbacks to install; ``[]`` for the unguarded run.
        seed: seeds the data, the initial weights and Lightning.
        root_dir: the TensorBoard root; the run writes ``<root_dir>/<task>/<config>-seed<seed>`` (and
            ``...-work`` for checkpoints), replacing what a previous run of the same name left there.
        max_epochs: overrides the task's default length.
        max_steps: optimizer steps limit (``-1``: none).
        healthy: run the task with its fault removed (the reference).
        config: the configuration's name; default ``"healthy"``/``"unguarded"``/``"custom"``.
        devices: CPU processes (``2`` with ``strategy="ddp_spawn"`` for the distributed variant).
        strategy: the Lightning strategy.

    Nanguard's documented errors (``NonFiniteTrainingError``, ``RecoveryBudgetExhausted``,
    ``CheckpointVerificationError``) and any other exception from ``fit`` end the run as not finished, with the error
    recorded; the run is also not finished when the final parameters, buffers or either loss are non-finite.
    """
    task = get_task(name)
    config = config or ("healthy" if healthy else ("unguarded" if not callbacks else "custom"))
    version = f"{config}-seed{seed}"
    work_dir = os.path.join(root_dir, name, f"{version}-work")
    for stale in (os.path.join(root_dir, name, version), work_dir):  # a rerun replaces its run, never appends to it
        shutil.rmtree(stale, ignore_errors=True)
    pl.seed_everything(seed, verbose=False)
    built = task.build(seed, healthy, work_dir)
    # What rebuilds this module for an offline replay of its incident bundles (``demo_module``, the demo's factory:
    # nanguard replay BUNDLE --factory lightning_nanguard.demo:demo_module).
    built.module.save_hyperparameters({"demo_task": name, "seed": seed})
    logger = TensorBoardLogger(root_dir, name=name, version=version, default_hp_metric=False)
    kwargs: dict[str, Any] = {
        "default_root_dir": work_dir,
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "max_epochs": max_epochs if max_epochs is not None else task.max_epochs,
        "max_steps": max_steps,
        "logger": logger,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 5,
    }
    kwargs.update(built.trainer_kwargs)
    kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
    if devices > 1:
        kwargs["callbacks"].append(_ReleaseProcessGroup())
    trainer = pl.Trainer(**kwargs)
    error = ""
    start = time.perf_counter()
    try:
        trainer.fit(built.module, datamodule=built.datamodule, **built.fit_kwargs)
    except NanGuardError as err:
        error = f"{type(err).__name__}: {err}"
    except Exception as err:  # anything else also ends the run unfinished; the table shows what
        known = next((n for n in _NANGUARD_ERRORS if n in str(err)), "")
        error = f"{known or type(err).__name__}: {err}"
    wall = time.perf_counter() - start
    log_dir = logger.log_dir
    incidents = _incidents(trainer, log_dir, devices)
    train_loss = probe_loss(built.module, built.datamodule.probe_dataloader())
    val = trainer.callback_metrics.get("val_loss")
    val_loss = float(val) if val is not None else math.nan
    state_ok = all(bool(torch.isfinite(t).all()) for t in _tensors(built.module))
    finished = not error and state_ok and math.isfinite(train_loss) and math.isfinite(val_loss)
    engine = get_engine(trainer)
    single = devices == 1
    return RunResult(
        task=name,
        config=config,
        healthy=healthy,
        seed=seed,
        finished=finished,
        error=error,
        train_loss=train_loss,
        val_loss=val_loss,
        incidents_by_cause=dict(_by_cause(incidents)),
        incidents=incidents,
        skipped_steps=engine.skipped_steps if single else _count(incidents, "skip", "scaler_skip"),
        rollbacks=_count(incidents, "rollback"),
        steps_rolled_back=sum(int(v) for i in incidents if isinstance(v := i.values.get("steps_lost"), (int, float))),
        lr_scale=lr_scale_of(trainer.optimizers[0]) if single and trainer.optimizers else _lr_scale(incidents),
        wall_time=wall,
        log_dir=log_dir,
        steps=trainer.global_step if single else -1,
    )


def _incidents(trainer: pl.Trainer, log_dir: str, devices: int) -> list[Incident]:
    if devices == 1:
        return list(get_engine(trainer).sink.records)
    path = os.path.join(log_dir, INCIDENTS_FILE)  # ddp_spawn: the ranks' engines died with them; rank 0 wrote this
    return IncidentLog.read(path) if os.path.exists(path) else []


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]


def _by_cause(incidents: list[Incident]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for i in incidents:
        counts[str(i.cause or i.trigger)] += i.count  # a recurring incident is one record with a count
    return counts


def _count(incidents: list[Incident], *actions: str) -> int:
    return sum(i.count for i in incidents if any(a in actions for a in (i.actions or [i.action])))


def _lr_scale(incidents: list[Incident]) -> float:
    for inc in reversed(incidents):
        after = inc.values.get("lr_scale_after")
        if isinstance(after, (int, float)):
            return float(after)
    return 1.0
