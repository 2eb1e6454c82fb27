"""Sense: one health reading per optimizer step, with one fused pass, one cross-rank reduction and one host read.

The step's numbers travel as one small device vector ``[grad norm, loss, scale]``: the total gradient norm (from
one ``_foreach_norm`` pass), the sum of the step's (micro-batch) losses as ``on_before_backward`` saw them, and the
GradScaler's scale (the loss and, for fused optimizers, the gradients are still multiplied by it). Under DDP the
vector is all-reduced with SUM: a NaN or inf on any rank makes the sum non-finite on every rank, so the verdict is
rank-consistent without a second collective, and the sum divided by the world size is the mean loss.

Two ways the vector reaches the host:

* **host path** (plain optimizers, no GradScaler): ``vec.tolist()`` in ``on_before_optimizer_step``, the step's one
  host read, so the update can be dropped before it lands;
* **device path** (a GradScaler, or a fused optimizer that takes ``found_inf``): the verdict stays on the device and
  is handed to the optimizer (``found_inf``), which skips the update itself; the vector is copied into a host mirror
  (pinned memory, non-blocking) and read at the batch end, after the GradScaler's own read has synchronized it
  (or, for a fused optimizer alone, once its CUDA event has completed). Zero extra host reads per healthy step.

Sharded parameters (``DTensor``) carry squared norms instead: ``engine/sharded_sensing.py``. Under plain DDP the
vector is as above.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.engine.plan import StepPlan, drop_path
from lightning_nanguard.engine.reading import DropPath, HostMirror, Layout, Pending, Reading, fill
from lightning_nanguard.engine.sharded_sensing import measure_sharded
from lightning_nanguard.signals.gradients import (
    GradNorms,
    ParamIndex,
    grad_norms,
    loss_sum,
    norms_with,
    step_vector,
    wrapper_prefixes,
)
from lightning_nanguard.signals.model_tensors import watched_buffers

__all__ = ["QuickStep", "Sensor"]


class QuickStep(NamedTuple):
    """``Sensor.quick``'s result: the step's host values as ``fill`` would compute them, and what made them."""

    plan: StepPlan
    vec: Tensor  # the step vector: the per-tensor norms, then the loss
    grad_norm: float
    loss: float
    step: int


class Sensor:
    """Computes the step reading. One per engine; the parameter index is cached per optimizer."""

    def __init__(self) -> None:
        self.layer_depth = 1
        self.world_size = 1  # set per measurement: the shares of sharded parameters depend on it
        self._indexes: dict[int, ParamIndex] = {}
        self._positions: dict[int, int] = {}  # id(optimizer) -> index in trainer.optimizers
        self._mirrors: dict[int, HostMirror] = {}
        self._device_path: dict[int, DropPath] = {}  # id(optimizer) -> how its update is dropped
        self._plans: dict[int, StepPlan] = {}  # id(optimizer) -> its plan
        self._last_plan: StepPlan | None = None  # the plan ``quick`` used last (one optimizer: every step's)
        self._zeros: dict[torch.device, Tensor] = {}
        self._buffers: list[list[Tensor]] = []  # watched buffers, one list per (device, dtype)
        self._watched: weakref.ref[nn.Module] | None = None  # the module whose buffers are watched

    def _zero(self, device: torch.device) -> Tensor:
        """A 0-d float32 zero on ``device``, made once (never written to: ``stack`` copies it)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), device=device)
        return zero

    def watch(self, module: nn.Module) -> None:
        """Watch ``module``'s buffers (``watch_buffers``) from now on, collected again by ``rewatch``."""
        self._watched = weakref.ref(module)
        self.watch_buffers(watched_buffers(module))

    def rewatch(self) -> None:
        """Collect the watched module's buffers again: a buffer can be a new tensor since (a lazy module's,
        materialized by the first forward; a cache registered again at another size; one a rollback reallocated).
        Called where that can have happened: the first step's plan, each epoch start, after a restore."""
        module = self._watched() if self._watched is not None else None
        if module is not None:
            self.watch_buffers(watched_buffers(module))

    def watch_buffers(self, buffers: list[Tensor]) -> None:
        """The buffers whose finiteness rides in every step's vector (BatchNorm statistics: a NaN written by the
        forward shows at that step, not at the next save)."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for b in buffers:
            groups.setdefault((b.device, b.dtype), []).append(b)
        self._buffers = list(groups.values())

    def _buffer_maxes(self, device: torch.device) -> list[Tensor]:
        """The step vector's buffer entries: 0-d float32 on ``device``, the largest |value| of the watched buffers,
        NaN or inf iff one holds NaN or inf (a max-abs never overflows, unlike a 2-norm; nor does their sum on the
        host). Empty when the module has no floating buffer (nothing is paid then). A group of float32 buffers on
        ``device`` (BatchNorm's statistics, the usual case) gives one entry per buffer: one ``_foreach_norm`` and
        nothing more. Any other group gives one entry, its ``stack``-ed maxes' ``amax``."""
        out: list[Tensor] = []
        for group in self._buffers:
            maxes = _lightning_compat.foreach_norm(group, math.inf)
            if group[0].dtype is torch.float32 and group[0].device == device:
                out.extend(maxes)
            else:
                out.append(_f32(torch.stack(maxes).amax(), device))
        return out

    def reset(self) -> None:
        self._buffers = []
        self._watched = None
        self._zeros.clear()
        self._indexes.clear()
        self._positions.clear()
        self._mirrors.clear()
        self._device_path.clear()
        self._plans.clear()
        self._last_plan = None

    # ------------------------------------------------------------------ structure (cached)
    def optimizer_index(self, trainer: pl.Trainer, optimizer: Optimizer) -> int:
        pos = self._positions.get(id(optimizer))
        if pos is None:
            pos = next(
                (
                    i
                    for i, opt in enumerate(trainer.optimizers)
                    if opt is optimizer or getattr(opt, "optimizer", None) is optimizer
                ),
                0,
            )
            self._positions[id(optimizer)] = pos
        return pos

    def param_index(self, pl_module: nn.Module, optimizer: Optimizer, opt_idx: int) -> ParamIndex:
        index = self._indexes.get(opt_idx)
        if index is None or not index.matches(optimizer):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            names = {id(p): n for n, p in pl_module.named_parameters()}
            index = ParamIndex(
                params,
                [names.get(id(p), "") for p in params],
                self.layer_depth,
                wrapper_prefixes(pl_module),
                world_size=self.world_size,
            )
            self._indexes[opt_idx] = index
        return index

    def path(self, trainer: pl.Trainer, optimizer: Optimizer) -> DropPath:
        """How this optimizer drops an update (``plan.drop_path``), decided on its first step."""
        key = id(optimizer)
        found = self._device_path.get(key)
        if found is None:
            found = self._device_path[key] = drop_path(trainer, optimizer)
        return found

    # ------------------------------------------------------------------ the reading
    def _plan(self, trainer: pl.Trainer, pl_module: nn.Module, optimizer: Optimizer) -> StepPlan:
        """Build this optimizer's plan (``measure`` reuses it while ``StepPlan.current``)."""
        self.world_size = trainer.world_size
        opt_idx = self.optimizer_index(trainer, optimizer)
        index = self.param_index(pl_module, optimizer, opt_idx)
        path = self.path(trainer, optimizer)
        if index.sharded and path is DropPath.FUSED:
            # A fused kernel over DTensors is handed no plain found_inf tensor: drop on the host (grads to None).
            path = self._device_path[id(optimizer)] = DropPath.HOST
        device = index.params[0].device if index.params else _first_device(pl_module)
        self.rewatch()  # after the first forward: a lazy module's buffers exist now
        plan = self._plans[id(optimizer)] = StepPlan(trainer, optimizer, opt_idx, index, path, device)
        self._last_plan = plan
        return plan

    def quick(self, optimizer: Optimizer, losses: list[Tensor], step: int) -> QuickStep | None:
        """``measure``'s device work and host read for the common step, written out without its layers: the host
        path on one process (``StepPlan.quick``), every gradient present, one float32 0-d loss on the parameters'
        device, no watched buffer. The same two device ops (one ``_foreach_norm``, one ``stack`` with the loss) and
        the same one host read, giving ``(plan, vector, grad norm, loss, step)`` with the values ``fill`` computes;
        ``quick_reading`` makes the ``Reading`` where one is needed (the engine accounts for a finite step without
        one). ``None`` (nothing done) where any condition fails: ``measure`` reads the step."""
        plan = self._last_plan
        if plan is None or plan.optimizer is not optimizer:
            plan = self._plans.get(id(optimizer))
            if plan is None:
                return None
            self._last_plan = plan
        if not plan.quick or len(losses) != 1 or self._buffers or not plan.same_params(optimizer):
            return None
        loss = losses[0]
        if loss.dtype is not _FLOAT32:
            return None
        try:
            # Detached: the optimizer runs its closure, and so this hook, with grad mode on.
            vec = step_vector(plan.params, (loss.detach(),))
        except RuntimeError:  # a loss that is not 0-d, or on another device than the gradients: ``measure``
            return None
        if vec is None:  # a gradient missing: ``measure``
            return None
        values = vec.tolist()  # the step's one host read
        k = plan.count
        squares = 0.0
        for i in range(k):
            squares += values[i] * values[i]
        return QuickStep(plan, vec, math.sqrt(squares), values[k], step)

    @staticmethod
    def quick_reading(quick: QuickStep, batch: int) -> Reading:
        """The ``Reading`` ``measure`` would have made of the step ``quick`` read (the inline layout)."""
        plan, vec, norm, loss, step = quick
        return Reading(
            step, plan.opt_idx, batch, norm, loss, None, True, GradNorms(vec=vec, count=plan.count), plan.index, vec,
            inline=plan.count,
        )  # fmt: skip

    def measure(
        self,
        trainer: pl.Trainer,
        pl_module: nn.Module,
        optimizer: Optimizer,
        losses: list[Tensor],
        *,
        step: int,
        batch: int,
        host_only: bool,
    ) -> Reading:
        """Measure the step. Host path: reads the host once. Device path: hands the verdict to the optimizer.

        Args:
            host_only: read the verdict now even where the optimizer could act on a device flag (a decision that
                needs host values before the update, e.g. dropping a spike).
        """
        plan = self._plans.get(id(optimizer))
        if plan is None or not plan.current(optimizer):
            plan = self._plan(trainer, pl_module, optimizer)
        index, path = plan.index, plan.path
        scaler = _lightning_compat.get_scaler(trainer) if path is DropPath.SCALER else None
        scale = _lightning_compat.scale_tensor(scaler) if scaler is not None else None
        # Fused optimizers under a GradScaler are not unscaled before this hook: their norm is divided here.
        fused_scaled = scale is not None and plan.handles_unscaling
        if index.sharded:
            pieces = grad_norms(index, scale=scale if fused_scaled else None)
            device = pieces.tensor_norms.device if pieces is not None else _first_device(pl_module)
            maxes = self._buffer_maxes(device) if self._buffers else []
            reading, head, layout = measure_sharded(
                trainer, plan, pieces, losses, scale, maxes, device, step=step, batch=batch
            )
            return self._deliver(reading, head, layout, optimizer, scaler, plan, host_only=host_only)
        device = plan.device
        loss = loss_sum(losses)
        tail = [_f32(self._zero(device) if loss is None else loss, device)]
        if scale is not None:
            tail.append(_f32(scale, device))
        probes = self._buffer_maxes(device) if self._buffers else ()
        tail.extend(probes)
        # The fast path for a few gradients: [norm_0, ..., norm_k-1, *tail] in one stack, the total summed on the
        # host (``norms_with``); else [total, *tail].
        fast = norms_with(index, tail) if plan.inline and not fused_scaled else None
        if fast is None and index.sparse and plan.inline:  # a sparse gradient seen only now: never inline again
            plan.inline = plan.quick = False
        norms: GradNorms | None
        if fast is not None:
            norms, vec = fast
            inline = index.count
        else:
            norms = grad_norms(index, scale=scale if fused_scaled else None)
            vec = torch.stack([_f32(norms.total if norms is not None else self._zero(device), device), *tail])
            inline = 0
        local = vec
        world = plan.world
        if world > 1:
            vec = _distributed.sum_across_ranks(trainer, vec)
        # Positional: keyword construction of the dataclass costs more.
        reading = Reading(step, plan.opt_idx, batch, math.nan, None, None, norms is not None, norms, index, local)
        reading.inline = inline
        layout = Layout(world, loss is not None, scale is not None, len(probes))
        return self._deliver(reading, vec, layout, optimizer, scaler, plan, host_only=host_only)

    def _deliver(
        self,
        reading: Reading,
        head: Tensor,
        layout: Layout,
        optimizer: Optimizer,
        scaler: object,
        plan: StepPlan,
        *,
        host_only: bool,
    ) -> Reading:
        """The reduced ``head`` vector to its consumer: read now (the step's one host read), or, on the device path,
        handed to the optimizer as its ``found_inf`` flag and copied to a host mirror read at the batch end."""
        path = reading.path = plan.path
        if host_only or path is DropPath.HOST:
            fill(reading, head.tolist(), layout)
            return reading
        if path is DropPath.SCALER:
            _lightning_compat.or_nonfinite_into_found_inf(scaler, optimizer, head)
        else:
            _lightning_compat.set_found_inf_where_nonfinite(optimizer, head)
        mirror = self._mirrors.get(plan.opt_idx)
        if mirror is None or mirror.size < head.numel():
            mirror = self._mirrors[plan.opt_idx] = HostMirror(max(4, head.numel()), head.device)
        mirror.fill(head)
        reading.pending = Pending(mirror, head.numel(), layout)
        return reading


_FLOAT32 = torch.float32


def _f32(t: Tensor, device: torch.device) -> Tensor:
    """``t`` as float32 on ``device``; itself when it already is (the healthy path: no conversion op)."""
    return t if t.dtype is torch.float32 and t.device == device else t.to(device=device, dtype=torch.float32)


def _first_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
