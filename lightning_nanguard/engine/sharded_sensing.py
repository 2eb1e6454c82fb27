"""The step reading for sharded gradients (``DTensor``: FSDP2's ``fully_shard``, tensor parallelism).

Each rank holds different pieces of the gradients, so the step vector carries *squared* norms instead, in float64:
``[squared total, loss, scale, buffer max, squared norm of each gradient...]``, where each rank's local squared norms
are weighted by their share of the world (``signals/sharded.py``). The same single SUM all-reduce as under DDP then
gives the global squared norms (the square root is taken after it), the summed loss and scale (divided by the world
size), and, from the per-gradient entries, the global per-tensor norms behind the per-layer norms, still on the
device. One host read of the head of the vector; no gradient is gathered.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_nanguard import _distributed
from lightning_nanguard.engine.plan import StepPlan
from lightning_nanguard.engine.reading import Layout, Reading
from lightning_nanguard.signals.gradients import GradNorms, ParamIndex, grad_norms, loss_sum, weighted_squares

__all__ = ["current_grad_norm", "measure_sharded"]


def measure_sharded(
    trainer: pl.Trainer,
    plan: StepPlan,
    norms: GradNorms | None,
    losses: list[Tensor],
    scale: Tensor | None,
    buffer_maxes: list[Tensor],
    device: torch.device,
    *,
    step: int,
    batch: int,
) -> tuple[Reading, Tensor, Layout]:
    """The reading (host values not filled yet), the reduced head of the vector to read, and its layout."""
    squares = weighted_squares(plan.index, norms, device)
    loss = loss_sum(losses)
    head = [squares.sum(), torch.zeros((), device=device) if loss is None else loss]
    if scale is not None:
        head.append(scale)
    if buffer_maxes:
        head.append(torch.stack(buffer_maxes).amax())
    k = len(head)
    local = torch.stack([h.to(device=device, dtype=torch.float64).reshape(()) for h in head])
    vec = torch.cat([local, squares])
    world = trainer.world_size
    if world > 1:
        vec = _distributed.sum_across_ranks(trainer, vec)
    reduced: GradNorms | None = None
    if norms is not None:
        per_tensor = vec[k:].sqrt().float()
        if norms.present is not None:
            per_tensor = per_tensor.index_select(
                0, torch.tensor(norms.present, dtype=torch.long, device=per_tensor.device)
            )
        reduced = GradNorms(tensor_norms=per_tensor, present=norms.present, _total=vec[0].sqrt().float())
    reading = Reading(
        step=step,
        optimizer_idx=plan.opt_idx,
        batch=batch,
        grad_norm=math.nan,
        loss=None,
        scale=None,
        has_grads=norms is not None,
        norms=reduced,
        index=plan.index,
        local=local,
    )
    # The step's one host read is the head only; the per-tensor norms stay on the device.
    layout = Layout(world, loss is not None, scale is not None, int(bool(buffer_maxes)), squared=True)
    return reading, vec[:k], layout


def current_grad_norm(trainer: pl.Trainer, index: ParamIndex) -> float | None:
    """The total 2-norm of the gradients on ``index``'s parameters *now* (e.g. after value clipping); ``None``
    when no parameter has a gradient. One fused pass and one host read.

    Sharded parameters: the global norm, from one SUM all-reduce of the weighted squared local norms, so this is a
    collective: call it on every rank (a rank-consistent decision, such as a logging step), never on one rank alone.
    Plain parameters: this rank's norm (under DDP every rank's gradients are the same), no collective.
    """
    norms = grad_norms(index)
    if not index.sharded:
        return None if norms is None else float(norms.total.to(torch.float32).item())
    if norms is not None:
        device = norms.total.device
    else:
        device = index.params[0].device if index.params else torch.device("cpu")
    present_flag = torch.tensor(float(norms is not None), dtype=torch.float64, device=device)
    squares = torch.stack([weighted_squares(index, norms, device).sum(), present_flag])
    if trainer.world_size > 1:
        squares = _distributed.sum_across_ranks(trainer, squares)
    total, present = squares.tolist()
    return math.sqrt(total) if present > 0 and total >= 0 else (math.nan if present > 0 else None)
