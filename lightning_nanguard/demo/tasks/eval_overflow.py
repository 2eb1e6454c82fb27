"""eval-overflow: a running sum that fits float16 on training crops and overflows on full-length validation sequences."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_nanguard.demo.common import DemoModule, TensorDataModule
from lightning_nanguard.demo.registry import Built, Task, register_task

OFFSET = 30.0  # raw sensor readings around 30 units
TRAIN_LEN, VAL_LEN = 64, 4096  # 30 * 4096 > 65504, the largest float16


class RunningMeanNet(nn.Module):
    """Predict each position from the running mean of the raw inputs so far, computed as a running *sum* divided by
    the position afterwards (the unnormalised accumulation of a linear scan), centred by a stored data mean.

    ``fp32_scan=True`` is the fix: the sum accumulates in float32 whatever the input dtype.
    """

    def __init__(self, d: int, hidden: int, fp32_scan: bool) -> None:
        super().__init__()
        self.centre: Tensor
        self.register_buffer("centre", torch.full((d,), OFFSET))
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.fp32_scan = fp32_scan

    def forward(self, x: Tensor) -> Tensor:
        s = torch.cumsum(x.float() if self.fp32_scan else x, dim=1)  # float16 under 16-true: inf past 65504
        pos = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=s.dtype).unsqueeze(-1)
        mean = (s / pos).to(x.dtype)
        return self.mlp(mean - self.centre).squeeze(-1)


def _sequences(g: torch.Generator, n: int, length: int, a: Tensor) -> tuple[Tensor, Tensor]:
    level = torch.randn(n, 1, a.numel(), generator=g)
    x = OFFSET + level + torch.randn(n, length, a.numel(), generator=g)
    running = torch.cumsum(x - OFFSET, dim=1) / torch.arange(1, length + 1).view(1, -1, 1)
    y = torch.tanh(running @ a) + 0.1 * torch.randn(n, length, generator=g)
    return x, y


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    g = torch.Generator().manual_seed(seed + 3)
    a = torch.randn(8, generator=g) / 8**0.5 * 2
    x, y = _sequences(g, 256, TRAIN_LEN, a)
    xv, yv = _sequences(g, 8, VAL_LEN, a)
    torch.manual_seed(seed)
    # eps=1e-4: representable in float16 (eps-underflow is another task).
    module = DemoModule(RunningMeanNet(8, 32, fp32_scan=healthy), lr=3e-3, opt_kw={"eps": 1e-4})
    data = TensorDataModule((x, y), (xv, yv), batch_size=16, val_batch_size=4)
    return Built(module, data, trainer_kwargs={"precision": "16-true"})


TASK = register_task(
    Task(
        name="eval-overflow",
        description="a running sum of raw inputs (about 30 units) in float16 (16-true): fine on 64-step training "
        "crops (sum ~1920), inf on 4096-step validation sequences (sum ~122880 > 65504)",
        failure="training is fine; every validation loss is NaN (EarlyStopping and ModelCheckpoint go blind)",
        causes=("half_precision_overflow",),
        precision="16-true",
        max_epochs=4,
        build=build,
    )
)
