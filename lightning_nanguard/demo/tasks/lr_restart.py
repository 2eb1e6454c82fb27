"""lr-restart: a warm restart of a cosine schedule that overshoots for a while, then the schedule is safe again."""

from __future__ import annotations

import math

from lightning_nanguard.demo.common import DemoModule, TensorDataModule
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression

BASE = 0.075  # stable for SGD+momentum on this task
TOTAL = 12 * 16  # optimizer steps of the run (12 epochs of 16 batches)
RESTART, WIDTH, PEAK = 32, 28, 7.0  # steps [32, 60) run at 7x the schedule: past the stability edge


def _cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(step, TOTAL) / TOTAL))


def _restart(step: int) -> float:
    return _cosine(step) * (PEAK if RESTART <= step < RESTART + WIDTH else 1.0)


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    x, y, xv, yv = teacher_regression(seed + 2, 512, 16)
    module = DemoModule(mlp(16, seed=seed), lr=BASE, optimizer="sgd", lr_lambda=_cosine if healthy else _restart)
    data = TensorDataModule((x, y), (xv, yv), batch_size=32)
    return Built(module, data)


TASK = register_task(
    Task(
        name="lr-restart",
        description="SGD+momentum on a cosine schedule with a warm restart to 7x for 28 steps (fp32): the run diverges "
        "during the restart; afterwards the schedule is safe again, so a learning rate cut for good is a cost",
        failure="the loss blows up during the restart and ends inf/NaN",
        causes=("gradient_explosion", "weights_diverging"),
        precision="32-true",
        max_epochs=12,
        build=build,
    )
)
