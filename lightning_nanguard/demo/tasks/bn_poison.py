"""bn-poison: one data shard in other units overflows fp16 in the forward and writes NaN into BatchNorm statistics."""

from __future__ import annotations

from lightning_nanguard.demo.common import DemoModule, TensorDataModule, precision_kwargs
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression

SHARD = slice(256, 288)  # one batch of the epoch (32 rows), recorded in other units
UNITS = 1e5


def build(seed: int, healthy: bool, work_dir: str, shuffle: bool = False) -> Built:
    """The task's run; ``shuffle``: the shard's rows spread over the epoch's batches (bn-poison-shuffled)."""
    x, y, xv, yv = teacher_regression(seed + 5, 512, 16)
    probe = (x.clone(), y.clone())
    if not healthy:
        x[SHARD] *= UNITS
    module = DemoModule(mlp(16, seed=seed, norm=True), lr=3e-3)
    data = TensorDataModule((x, y), (xv, yv), batch_size=32, probe=probe, shuffle=shuffle, seed=seed)
    return Built(module, data, trainer_kwargs=precision_kwargs("16-mixed"))


TASK = register_task(
    Task(
        name="bn-poison",
        description="a 32-row shard in other units (x1e5) under 16-mixed: the first Linear overflows fp16, BatchNorm "
        "folds inf into its running statistics in the forward; the GradScaler drops the update, so training looks fine",
        failure="BatchNorm running mean/var are NaN after the shard's first pass: every eval-mode output (validation) "
        "is NaN, every epoch",
        causes=("corrupt_state",),
        precision="16-mixed",
        max_epochs=4,
        build=build,
    )
)
