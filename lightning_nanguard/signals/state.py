"""Evidence from the training state (incident path only): which tensors are non-finite, and could the optimizer
have made them so?

``trial_adam_update`` recomputes the last Adam/AdamW update from the optimizer's own (finite) moments, in the
parameter's dtype and exactly as torch computes it (``m / bc1 / (sqrt(v) / sqrt(bc2) + eps)``), without touching
anything: when finite gradients gave finite moments and the update is still non-finite, the optimizer's numerics
made the weights non-finite (the eps=1e-8 that is 0 in float16 is the classic case).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard.signals.model_tensors import nonfinite_names

__all__ = ["StateFindings", "eps_underflows", "read_state", "trial_adam_update"]


@dataclass(frozen=True)
class StateFindings:
    """The non-finite state of one rank by kind, and the optimizer's part in it (plain values)."""

    parameters: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    optimizer: tuple[str, ...] = ()
    buffer_modules: tuple[str, ...] = ()  # modules owning the non-finite buffers (e.g. a BatchNorm)
    update_nonfinite: tuple[str, ...] = ()  # parameters whose Adam update, recomputed from finite moments, is not
    eps_underflow: tuple[str, ...] = ()  # "group 0: eps=1e-08 is 0 in torch.float16"

    @property
    def names(self) -> tuple[str, ...]:
        return self.parameters + self.buffers + self.optimizer


def eps_underflows(optimizers: Sequence[Optimizer]) -> list[str]:
    """Optimizer groups whose ``eps`` rounds to 0 or a subnormal in the dtype of their parameters."""
    out: list[str] = []
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            eps = group.get("eps")
            if not isinstance(eps, (int, float)) or eps <= 0:
                continue
            for dtype in sorted({p.dtype for p in group["params"] if p.is_floating_point()}, key=str):
                if eps < torch.finfo(dtype).tiny:
                    as_dtype = float(torch.tensor(eps, dtype=dtype))
                    state = "0" if as_dtype == 0.0 else f"subnormal ({as_dtype:.3g})"
                    out.append(f"optimizer{i} group {g}: eps={eps:g} is {state} in {dtype}")
    return out


def trial_adam_update(optimizer: Optimizer, param: Tensor) -> Tensor | None:
    """The update Adam/AdamW would make (or made) from ``param``'s current moments, in the parameter's dtype; ``None``
    when the optimizer keeps no Adam moments for it. Reads the state only."""
    state = optimizer.state.get(param)
    if not state or "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
        return None
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None or "betas" not in group:
        return None
    beta1, beta2 = group["betas"]
    eps, lr = float(group.get("eps", 1e-8)), float(group["lr"])
    step = float(state["step"])
    if step <= 0:
        return None
    m, v = state["exp_avg"], state.get("max_exp_avg_sq", state["exp_avg_sq"])
    with torch.no_grad():
        bc1 = 1 - float(beta1) ** step
        bc2_sqrt = math.sqrt(1 - float(beta2) ** step)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        return (m / denom) * (-lr / bc1)


def read_state(module: nn.Module, optimizers: Sequence[Optimizer], names: Sequence[str] | None = None) -> StateFindings:
    """Classify the non-finite tensors of one rank (``names``: the engine's gathered list, else found here)."""
    found = list(names) if names is not None else nonfinite_names(module, optimizers)
    param_names = {n for n, _ in module.named_parameters()}
    buffer_names = {n for n, _ in module.named_buffers()}
    params = tuple(n for n in found if n in param_names)
    buffers = tuple(n for n in found if n in buffer_names)
    opt = tuple(n for n in found if n not in param_names and n not in buffer_names)
    owners: list[str] = []
    for b in buffers:
        owner = b.rsplit(".", 1)[0] if "." in b else ""
        if owner not in owners:
            owners.append(owner)
    by_name = dict(module.named_parameters())
    update_bad: list[str] = []
    for name in params:
        p = by_name[name]
        for optimizer in optimizers:
            update = trial_adam_update(optimizer, p)
            if update is not None and not bool(torch.isfinite(update).all()):
                update_bad.append(name)
                break
    return StateFindings(
        parameters=params,
        buffers=buffers,
        optimizer=opt,
        buffer_modules=tuple(owners),
        update_nonfinite=tuple(update_bad),
        eps_underflow=tuple(eps_underflows(optimizers)),
    )
