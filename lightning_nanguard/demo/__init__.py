"""Demo tasks: small CPU-only training runs with honest instabilities, each with its healthy twin, and a runner.

Each registered task (``task_names()``) builds a LightningModule and a DataModule from a seed, with a ``healthy``
switch that removes the fault and nothing else. ``run_task`` fits one under a list of callbacks and judges it;
``python -m lightning_nanguard.demo.table`` compares none / the preset / each callback alone on every task.
"""

from lightning_nanguard.demo.presets import CONFIGS, preset
from lightning_nanguard.demo.registry import Built, Task, demo_module, get_task, register_task, task_names
from lightning_nanguard.demo.runner import RunResult, run_task

__all__ = [
    "CONFIGS",
    "Built",
    "RunResult",
    "Task",
    "demo_module",
    "get_task",
    "preset",
    "register_task",
    "run_task",
    "task_names",
]
