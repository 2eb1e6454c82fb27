"""bad-data: one NaN row in 512 (a corrupt record), seen once per epoch, float32."""

from __future__ import annotations

import math

from lightning_nanguard.demo.common import DemoModule, TensorDataModule
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression

BAD_ROW = 300


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    x, y, xv, yv = teacher_regression(seed, 512, 16)
    probe = (x.clone(), y.clone())
    if not healthy:
        x[BAD_ROW, 3] = math.nan  # a corrupt record: one missing feature parsed as NaN
    module = DemoModule(mlp(16, seed=seed), lr=3e-3)
    data = TensorDataModule((x, y), (xv, yv), batch_size=32, probe=probe)
    return Built(module, data)


TASK = register_task(
    Task(
        name="bad-data",
        description="one NaN feature in row 300 of 512, met once per epoch (fp32, AdamW): one update poisons every weight",
        failure="the first epoch's bad batch makes the loss and then every weight NaN",
        causes=("input_data",),
        precision="32-true",
        max_epochs=6,
        build=build,
    )
)
