"""bn-poison-shuffled: the bn-poison shard, shuffled into every batch: each batch's forward poisons BatchNorm anew."""

from __future__ import annotations

from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks import bn_poison


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    return bn_poison.build(seed, healthy, work_dir, shuffle=True)


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
