"""A running z-score on the device: is this step's value a spike against the recent ones? No host read.

Values are compared in log space, so the test is scale-free (a 10x jump is the same spike at loss 3.0 or 0.003) and
a loss or gradient norm that drifts down over training does not look like a spike. Statistics are an exponential
moving mean and variance; they are updated only with finite, non-spiking values, so a spike does not teach the
detector that spikes are normal.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RunningZScore"]

_MIN_STD = 0.05  # log-space floor: below ~5% relative noise, a z-score would flag ordinary jitter


class RunningZScore:
    """Flags values more than ``threshold`` standard deviations above the running mean of their logarithm.

    Args:
        threshold: z-score above which a value is a spike.
        warmup: values observed before any is tested.
        beta: EMA decay of the mean and variance (``0.98``: about the last 50 values).
    """

    def __init__(self, threshold: float, warmup: int, beta: float = 0.98) -> None:
        self.threshold, self.warmup, self.beta = float(threshold), int(warmup), float(beta)
        self.mean = torch.zeros(())
        self.var = torch.zeros(())
        self.count = torch.zeros((), dtype=torch.long)
        self.last_z = torch.zeros(())

    def observe(self, value: Tensor) -> Tensor:
        """Test ``value`` (0-d, positive) and fold it into the statistics unless it spiked. Returns a 0-d bool."""
        if self.mean.device != value.device:
            self.to(value.device)
        x = torch.log(value.detach().float().clamp_min(1e-30))
        finite = torch.isfinite(x)
        std = torch.sqrt(self.var).clamp_min(_MIN_STD)
        z = torch.where(finite, (x - self.mean) / std, torch.zeros_like(x))
        spike = finite & (self.count >= self.warmup) & (z > self.threshold)
        update = finite & ~spike
        first = self.count == 0
        delta = torch.where(finite, x - self.mean, torch.zeros_like(x))
        new_mean = torch.where(first, x, self.mean + (1 - self.beta) * delta)
        new_var = torch.where(first, torch.zeros_like(x), self.beta * (self.var + (1 - self.beta) * delta * delta))
        self.mean = torch.where(update, new_mean, self.mean)
        self.var = torch.where(update, new_var, self.var)
        self.count = self.count + update.long()
        self.last_z = z
        return spike

    def to(self, device: torch.device) -> None:
        self.mean, self.var = self.mean.to(device), self.var.to(device)
        self.count, self.last_z = self.count.to(device), self.last_z.to(device)

    def state(self) -> dict[str, float]:
        """Host values for a checkpoint (host reads: call only when saving)."""
        return {"mean": float(self.mean), "var": float(self.var), "count": float(self.count)}

    def load(self, state: dict[str, float]) -> None:
        self.mean = torch.tensor(float(state.get("mean", 0.0)))
        self.var = torch.tensor(float(state.get("var", 0.0)))
        self.count = torch.tensor(int(state.get("count", 0)), dtype=torch.long)
