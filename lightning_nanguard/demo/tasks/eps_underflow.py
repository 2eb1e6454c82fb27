"""eps-underflow: AdamW eps=1e-8 under 16-true is 0 in float16; a zero gradient entry then divides 0 by 0."""

from __future__ import annotations

import torch
from torch import nn

from lightning_nanguard.demo.common import DemoModule, TensorDataModule
from lightning_nanguard.demo.registry import Built, Task, register_task

D = 64


def _data(g: torch.Generator, n: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Sparse count features (bag of words): most columns are zero in a whole batch, so their gradients are exactly 0.
    x = torch.poisson(torch.full((n, D), 0.03), generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def build(seed: int, healthy: bool, work_dir: str) -> Built:
    g = torch.Generator().manual_seed(seed + 4)
    w = torch.randn(D, 1, generator=g)
    x, y = _data(g, 512, w)
    xv, yv = _data(g, 256, w)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(D, 64), nn.Tanh(), nn.Linear(64, 1))
    module = DemoModule(net, lr=3e-3, opt_kw={"eps": 1e-4 if healthy else 1e-8})
    return Built(module, TensorDataModule((x, y), (xv, yv), batch_size=32), trainer_kwargs={"precision": "16-true"})


TASK = register_task(
    Task(
        name="eps-underflow",
        description="AdamW(eps=1e-8) on float16 parameters (16-true): eps rounds to 0, so a weight whose gradient is "
        "exactly 0 (sparse count features) gets 0/0 = NaN at step 1",
        failure="after the first step the first layer's weights are NaN, then everything is",
        causes=("optimizer_numerics",),
        precision="16-true",
        max_epochs=4,
        build=build,
    )
)
