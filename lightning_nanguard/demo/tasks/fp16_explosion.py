"""fp16-explosion: SGD above its stability limit under 16-mixed; the weights grow until float16 cannot hold the outputs."""

from __future__ import annotations

from lightning_nanguard.demo.common import DemoModule, TensorDataModule, precision_kwargs
from lightning_nanguard.demo.registry import Built, Task, register_task
from lightning_nanguard.demo.tasks._data import mlp, teacher_regression

HEALTHY_LR = 0.15
FAULTY_LR = 0.3  # past 2 / lambda_max of the loss: every step overshoots further than the last


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    x, y, xv, yv = teacher_regression(seed + 1, 512, 16)
    module = DemoModule(mlp(16, seed=seed), lr=HEALTHY_LR if healthy else FAULTY_LR, optimizer="sgd")
    data = TensorDataModule((x, y), (xv, yv), batch_size=32)
    return Built(module, data, trainer_kwargs=precision_kwargs("16-mixed"))


TASK = register_task(
    Task(
        name="fp16-explosion",
        description="SGD+momentum at 2x the stable learning rate under 16-mixed: every step overshoots further than "
        "the last, and the weights grow until float16 cannot hold the model's outputs",
        failure="the training loss grows geometrically (to about 7e9 in 6 epochs with seed 0) and the validation "
        "loss, computed in float16, overflows to NaN: the run ends with weights far from any solution",
        causes=("gradient_explosion", "weights_diverging"),
        precision="16-mixed",
        max_epochs=6,
        build=build,
    )
)
