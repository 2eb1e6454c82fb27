"""bn-poison-shuffled: the bn-poison shard, shuffled into every batch: each batch's forward poisons BatchNorm anew."""

from __future__ import annotations

from lightning_nanguard.demo.common import DemoModule, TensorDataModule, precision_kwargs
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression
from lightning_nanguard.demo.tasks.bn_poison import SHARD, UNITS


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    x, y, xv, yv = teacher_regression(seed + 5, 512, 16)
    probe = (x.clone(), y.clone())
    if not healthy:
        x[SHARD] *= UNITS
    module = DemoModule(mlp(16, seed=seed, norm=True), lr=3e-3)
    data = TensorDataModule((x, y), (xv, yv), batch_size=32, probe=probe, shuffle=True, seed=seed)
    return Built(module, data, trainer_kwargs=precision_kwargs("16-mixed"))


TASK = register_task(
    Task(
        name="bn-poison-shuffled",
        description="bn-poison's 32-row shard (x1e5) shuffled: 1-4 of its rows in nearly every batch of the first epoch, "
        "each batch's fp16 forward folding inf into BatchNorm's running statistics again",
        failure="BatchNorm running mean/var are NaN from the first batch: every eval-mode output (validation) is NaN",
        causes=("corrupt_state",),
        precision="16-mixed",
        max_epochs=4,
        build=build,
    )
)
