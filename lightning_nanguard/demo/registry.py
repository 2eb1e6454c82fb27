"""The demo task registry: each task is a small, CPU-only training run with an honest instability and its cure."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.demo.common import DemoModule, TensorDataModule

__all__ = ["Built", "Task", "demo_module", "get_task", "register_task", "task_names"]


@dataclass
class Built:
    """One task instance, ready to fit.

    Attributes:
        module: the LightningModule.
        datamodule: the data (with ``probe_dataloader()``: the training data with the fault removed).
        trainer_kwargs: precision settings (and anything else the mechanism needs) for the ``Trainer``.
        fit_kwargs: extra ``Trainer.fit`` arguments (``ckpt_path`` for a resume).
    """

    module: DemoModule
    datamodule: TensorDataModule
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    fit_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """A registered demo task.

    Attributes:
        name: the registry key (``"fp16-explosion"``).
        description: the mechanism, in one line.
        failure: what the unguarded run does.
        causes: the ``Incident.cause`` values a correct diagnosis names.
        precision: the training precision (for tables).
        max_epochs: the default length of a run.
        build: ``build(seed, healthy, work_dir) -> Built``; ``healthy=True`` removes the fault and nothing else;
            ``work_dir`` is a private directory for anything the task must write first (checkpoints to resume).
    """

    name: str
    description: str
    failure: str
    causes: tuple[str, ...]
    precision: str
    max_epochs: int
    build: Callable[[int, bool, str], Built]


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add ``task`` to the registry (a name is registered once)."""
    if task.name in _TASKS and _TASKS[task.name] is not task:
        raise ValueError(f"demo task {task.name!r} is already registered")
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The task registered as ``name``; ``KeyError`` naming the known tasks otherwise."""
    _load_builtin()
    try:
        return _TASKS[name]
    except KeyError:
        raise KeyError(f"unknown demo task {name!r}; known: {', '.join(task_names())}") from None


def demo_module(demo_task: str, seed: int = 0) -> DemoModule:
    """The LightningModule of a demo task, built as ``nanguard demo`` builds it (its weights come from the bundle):
    the factory of ``nanguard replay BUNDLE --factory lightning_nanguard.demo:demo_module``, which calls it with the
    ``demo_task`` and ``seed`` the demo's runner recorded as the module's hyperparameters."""
    with tempfile.TemporaryDirectory() as work_dir:
        return get_task(demo_task).build(seed, True, work_dir).module


def task_names() -> list[str]:
    """Every registered task, built-ins first in a fixed order."""
    _load_builtin()
    return list(_TASKS)


def _load_builtin() -> None:
    import lightning_nanguard.demo.tasks  # noqa: F401  (registers the built-in tasks on import)
