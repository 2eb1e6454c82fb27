"""spike-then-diverge: a warmup that ends past the stable learning rate; the loss spikes, recovers, then diverges."""

from __future__ import annotations

from lightning_nanguard.demo.common import DemoModule, TensorDataModule
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression

WARMUP_STEPS = 40
HEALTHY_PEAK = 0.075
FAULTY_PEAK = 0.3


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP_STEPS)


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    x, y, xv, yv = teacher_regression(seed + 2, 512, 16)
    module = DemoModule(
        mlp(16, seed=seed), lr=HEALTHY_PEAK if healthy else FAULTY_PEAK, optimizer="sgd", lr_lambda=_warmup
    )
    data = TensorDataModule((x, y), (xv, yv), batch_size=32)
    return Built(module, data)


TASK = register_task(
    Task(
        name="spike-then-diverge",
        description="SGD+momentum warmed up to 4x the stable learning rate (fp32): as the warmup crosses the "
        "stability edge the loss spikes, then the oscillation grows until it overflows",
        failure="loss spikes during warmup, then grows without bound to inf/NaN",
        causes=("gradient_explosion", "weights_diverging"),
        precision="32-true",
        max_epochs=12,
        build=build,
    )
)
