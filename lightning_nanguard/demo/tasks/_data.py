"""Synthetic data from a fixed seed: a random teacher network plus label noise (a loss floor both runs can reach)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["mlp", "teacher_regression"]


def teacher_regression(seed: int, n: int, d: int, *, noise: float = 0.1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_val, y_val)``: ``n`` training and ``n // 2`` validation rows of a fixed teacher."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(d, 32, generator=g) / d**0.5
    w2 = torch.randn(32, 1, generator=g) / 32**0.5

    def make(rows: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(rows, d, generator=g)
        y = torch.tanh(x @ w1) @ w2 + noise * torch.randn(rows, 1, generator=g)
        return x, y

    x, y = make(n)
    xv, yv = make(n // 2)
    return x, y, xv, yv


def mlp(d: int, hidden: int = 64, *, seed: int, norm: bool = False) -> nn.Module:
    """A small MLP ``d -> hidden -> hidden -> 1``, initialised from ``seed`` (BatchNorm after each hidden Linear)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = d
    for _ in range(2):
        layers.append(nn.Linear(width, hidden))
        if norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.Tanh())
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)
