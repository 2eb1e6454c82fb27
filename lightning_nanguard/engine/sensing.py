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

**Sharded parameters** (``DTensor``: ModelParallelStrategy with FSDP2's ``fully_shard``, tensor parallelism): each
rank holds different pieces of the gradients, so the vector carries *squared* norms instead, in float64:
``[squared total, loss, scale, squared norm of each gradient...]``, where each rank's local squared norms are
weighted by their share of the world (``signals/sharded.py``). The same single SUM all-reduce then gives the global
squared norms (the square root is taken after it), the summed loss and scale (divided by the world size as under
DDP), and, from the per-gradient entries, the global per-tensor norms behind the per-layer norms, still on the
device. One host read of the head of the vector, as before; no gradient is gathered. Under plain DDP (no
``DTensor``) the vector is exactly as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_nanguard import _distributed, _lightning_compat
from lightning_nanguard.recovery.host_memory import protect_forked_children
from lightning_nanguard.signals.gradients import (
    GradNorms,
    ParamIndex,
    grad_norms,
    inline_applies,
    norms_with,
    weighted_squares,
)

__all__ = ["HostMirror", "QuickStep", "Reading", "Sensor", "current_grad_norm", "wrapper_prefixes"]


@dataclass(slots=True)
class Reading:
    """The health of one optimizer step, as host values identical on every rank (after the reduction).

    Attributes:
        step: ``trainer.global_step`` of the step (before its update).
        optimizer_idx: which optimizer (manual optimization can step several per batch).
        batch: the training batch counter, to tie the reading to its batch.
        grad_norm: total unscaled pre-clip 2-norm of the gradients (mean over ranks; NaN/inf when non-finite).
        loss: mean over ranks of the unscaled step loss; ``None`` when no loss was seen (no backward).
        scale: the GradScaler scale the step ran with, or ``None``.
        has_grads: any gradient was present.
        norms: the device-side per-tensor norms (per-layer norms, forensics); ``None`` when no gradient.
        local: this rank's own ``[grad norm, loss]`` device vector, for the incident path's per-rank attribution.
        device_skipped: the update was dropped on the device (device path, non-finite verdict).
        buffers_finite: the module's watched buffers (``state_check.watched_buffers``) were finite at this step.
        inline: ``local`` (and the reduced vector) start with this many per-tensor norms instead of the total.
        path: how this optimizer drops an update (``Sensor.path``): ``"host"``, ``"scaler"`` or ``"fused"``.
        pending: device path only, until the batch end: what ``Sensor.resolve`` needs to fill the host values.
    """

    step: int
    optimizer_idx: int
    batch: int
    grad_norm: float
    loss: float | None
    scale: float | None
    has_grads: bool
    norms: GradNorms | None
    index: ParamIndex
    local: Tensor | None = None
    device_skipped: bool = False
    buffers_finite: bool = True
    inline: int = 0  # the vector carries this many per-tensor norms first (the fast path), not the total
    dropped: bool = False  # the update was dropped (by nanguard or the GradScaler), filled in by the engine
    spike: str = ""  # "loss_spike" / "grad_norm_spike" / "loss_and_grad_norm_spike", filled in by the engine
    path: str = ""
    pending: tuple[Any, ...] | None = None
    zscores: dict[str, float] | None = None  # a spike: the z-scores that flagged it
    state_before: Any = None  # a bad step (incident path): the state as it was before the update

    @property
    def loss_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)

    @property
    def grads_finite(self) -> bool:
        return math.isfinite(self.grad_norm)

    @property
    def bad(self) -> bool:
        """The step is non-finite on some rank (loss, gradients or a watched buffer). Read several times per step:
        written out rather than through ``grads_finite``/``loss_finite``."""
        loss = self.loss
        return not (self.buffers_finite and math.isfinite(self.grad_norm) and (loss is None or math.isfinite(loss)))


# ``Sensor.quick``'s result: (plan, the device vector, grad norm, loss, step), host floats as ``fill`` gives them.
QuickStep = tuple["_Plan", Tensor, float, float, int]


class HostMirror:
    """A small host buffer the device vector is copied into without a synchronization (pinned, non-blocking).

    Reading it is free once the copy has completed: after any later synchronization (the GradScaler's own
    ``found_inf`` read), or when its CUDA event reports completion. On CPU the copy is synchronous.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            protect_forked_children()  # a forked DataLoader worker must never free this buffer (host_memory.py)
        self.buffer = torch.empty(size, dtype=torch.float64, pin_memory=self.cuda)
        self.buffer._nanguard_host = True  # type: ignore[attr-defined]  # a host buffer: reading it is no device read
        self.array = self.buffer.numpy()  # the same memory: ``values`` reads it with no tensor op
        self.event: Any = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
        self.size = size
        self._views: dict[int, Tensor] = {}  # n -> buffer[:n], made once

    def fill(self, vec: Tensor) -> None:
        n = vec.numel()
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.buffer[:n]
        # On the CPU ``copy_`` converts to float64 itself; from CUDA the vector is widened on the device first.
        view.copy_(vec.detach().double() if self.cuda else vec.detach(), non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def values(self, n: int) -> list[float]:
        if self.event is not None and not self.event.query():
            self.event.synchronize()  # old work only: the step it belongs to has been queued long ago
        return self.array[:n].tolist()  # type: ignore[no-any-return]


def wrapper_prefixes(module: nn.Module) -> tuple[str, ...]:
    """The chain of single-child wrappers that hold every parameter (``self.model = nn.Sequential(...)``)."""
    prefix, current = "", module
    out: list[str] = []
    total = sum(1 for _ in module.parameters())
    while True:
        children = [(n, c) for n, c in current.named_children() if any(True for _ in c.parameters())]
        if len(children) != 1 or sum(1 for _ in children[0][1].parameters()) != total:
            return tuple(out)
        name, current = children[0]
        prefix = f"{prefix}{name}"
        out.append(prefix)
        prefix += "."


class _Plan:
    """What one optimizer's reading needs that does not change from step to step, built on its first step.

    ``quick``: ``Sensor.quick`` reads this optimizer's steps (the host path on one process, a few plain float32 or
    float64 gradients of one device, no loss scale)."""

    __slots__ = (
        "count",
        "device",
        "group_params",
        "handles_unscaling",
        "index",
        "inline",
        "opt_idx",
        "optimizer",
        "params",
        "path",
        "quick",
        "world",
    )

    def __init__(
        self,
        trainer: pl.Trainer,
        optimizer: Optimizer,
        opt_idx: int,
        index: ParamIndex,
        path: str,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.opt_idx = opt_idx
        self.index = index
        self.path = path
        self.device = device
        self.world = trainer.world_size
        self.handles_unscaling = _lightning_compat.optimizer_handles_unscaling(optimizer)
        self.inline = inline_applies(index)
        self.params = index.params
        self.count = index.count
        groups = optimizer.param_groups
        self.group_params = groups[0]["params"] if len(groups) == 1 else None  # ``same_params``'s shortcut
        self.quick = (
            self.inline
            and path == "host"
            and self.world == 1
            and index.params[0].dtype in (torch.float32, torch.float64)
        )

    def current(self, optimizer: Optimizer) -> bool:
        """Still valid: the same optimizer object, holding the same parameters (``ParamIndex.matches``)."""
        return self.optimizer is optimizer and self.index.matches(optimizer)

    def same_params(self, optimizer: Optimizer) -> bool:
        """``current``, with a shortcut for one param group: still the same list of parameters, of the same length."""
        groups = optimizer.param_groups
        if len(groups) == 1 and self.optimizer is optimizer:
            params = groups[0]["params"]
            if params is self.group_params and len(self.group_params) == self.index.count:
                return True
        return self.current(optimizer)


class Sensor:
    """Computes the step reading. One per engine; the parameter index is cached per optimizer."""

    def __init__(self) -> None:
        self.layer_depth = 1
        self.world_size = 1  # set per measurement: the shares of sharded parameters depend on it
        self._indexes: dict[int, ParamIndex] = {}
        self._positions: dict[int, int] = {}  # id(optimizer) -> index in trainer.optimizers
        self._mirrors: dict[int, HostMirror] = {}
        self._device_path: dict[int, str] = {}  # id(optimizer) -> "host" | "scaler" | "fused"
        self._plans: dict[int, _Plan] = {}  # id(optimizer) -> its plan
        self._last_plan: _Plan | None = None  # the plan ``quick`` used last (one optimizer: every step's)
        self._zeros: dict[torch.device, Tensor] = {}
        self._buffers: list[list[Tensor]] = []  # watched buffers, one list per (device, dtype)

    def _zero(self, device: torch.device) -> Tensor:
        """A 0-d float32 zero on ``device``, made once (never written to: ``stack`` copies it)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), device=device)
        return zero

    def watch_buffers(self, buffers: list[Tensor]) -> None:
        """The buffers whose finiteness rides in every step's vector (BatchNorm statistics: a NaN written by the
        forward shows at that step, not at the next save). Set at the start of training."""
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
            maxes = torch._foreach_norm(group, math.inf)
            if group[0].dtype is torch.float32 and group[0].device == device:
                out.extend(maxes)
            else:
                out.append(_f32(torch.stack(maxes).amax(), device))
        return out

    def reset(self) -> None:
        self._buffers = []
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

    def path(self, trainer: pl.Trainer, optimizer: Optimizer) -> str:
        """How this optimizer drops an update: ``"host"`` (grads to None), ``"scaler"`` or ``"fused"``."""
        key = id(optimizer)
        found = self._device_path.get(key)
        if found is None:
            scaler = _lightning_compat.get_scaler(trainer)
            if scaler is not None and scaler.is_enabled():
                found = "scaler"
            elif _lightning_compat.accepts_found_inf(optimizer):
                found = "fused"
            else:
                found = "host"
            self._device_path[key] = found
        return found

    # ------------------------------------------------------------------ the reading
    def _plan(self, trainer: pl.Trainer, pl_module: nn.Module, optimizer: Optimizer) -> _Plan:
        """Build this optimizer's plan (``measure`` reuses it while ``_Plan.current``)."""
        self.world_size = trainer.world_size
        opt_idx = self.optimizer_index(trainer, optimizer)
        index = self.param_index(pl_module, optimizer, opt_idx)
        path = self.path(trainer, optimizer)
        if index.sharded and path == "fused":
            # A fused kernel over DTensors is handed no plain found_inf tensor: drop on the host (grads to None).
            path = self._device_path[id(optimizer)] = "host"
        device = index.params[0].device if index.params else _first_device(pl_module)
        plan = self._plans[id(optimizer)] = _Plan(trainer, optimizer, opt_idx, index, path, device)
        self._last_plan = plan
        return plan

    def quick(self, optimizer: Optimizer, losses: list[Tensor], step: int) -> QuickStep | None:
        """``measure``'s device work and host read for the common step, written out without its layers: the host
        path on one process (``_Plan.quick``), every gradient present, one float32 0-d loss on the parameters'
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
        grads = [p.grad for p in plan.params]
        for g in grads:
            if g is None:
                return None
        try:
            # Detached: the optimizer runs its closure, and so this hook, with grad mode on.
            vec = torch.stack([*torch._foreach_norm(grads, 2), loss.detach()])  # type: ignore[arg-type]
        except RuntimeError:  # a loss that is not 0-d, or on another device than the gradients: ``measure``
            return None
        values = vec.tolist()  # the step's one host read
        k = plan.count
        squares = 0.0
        for i in range(k):
            squares += values[i] * values[i]
        return plan, vec, math.sqrt(squares), values[k], step

    @staticmethod
    def quick_reading(quick: QuickStep, batch: int) -> Reading:
        """The ``Reading`` ``measure`` would have made of the step ``quick`` read (the inline layout)."""
        plan, vec, norm, loss, step = quick
        return Reading(
            step, plan.opt_idx, batch, norm, loss, None, True, GradNorms(vec=vec, count=plan.count), plan.index, vec,
            inline=plan.count, path="host",
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
        index, path, opt_idx = plan.index, plan.path, plan.opt_idx
        scaler = _lightning_compat.get_scaler(trainer) if path == "scaler" else None
        scale = _lightning_compat.scale_tensor(scaler) if scaler is not None else None
        # Fused optimizers under a GradScaler are not unscaled before this hook: their norm is divided here.
        fused_scaled = scale is not None and plan.handles_unscaling
        if index.sharded:
            return self._measure_sharded(
                trainer,
                pl_module,
                optimizer,
                index,
                grad_norms(index, scale=scale if fused_scaled else None),
                losses,
                scaler,
                scale,
                path,
                opt_idx,
                step,
                batch,
                host_only,
            )
        device = plan.device
        loss = _loss_sum(losses)
        tail = [_f32(self._zero(device) if loss is None else loss, device)]
        if scale is not None:
            tail.append(_f32(scale, device))
        probes = self._buffer_maxes(device) if self._buffers else ()
        tail.extend(probes)
        # The fast path for a few gradients: [norm_0, ..., norm_k-1, *tail] in one stack, the total summed on the
        # host (``norms_with``); else [total, *tail].
        fast = norms_with(index, tail) if plan.inline and not fused_scaled else None
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
        # Positional: this runs every step (keyword construction of the dataclass costs more).
        reading = Reading(step, opt_idx, batch, math.nan, None, None, norms is not None, norms, index, local)
        reading.inline = inline
        return self._deliver(
            reading,
            vec,
            optimizer,
            scaler,
            path,
            opt_idx,
            world,
            loss is not None,
            scale is not None,
            len(probes),
            host_only=host_only,
            squared=False,
        )

    def _deliver(
        self,
        reading: Reading,
        head: Tensor,
        optimizer: Optimizer,
        scaler: Any,
        path: str,
        opt_idx: int,
        world: int,
        has_loss: bool,
        has_scale: bool,
        probes: int,
        *,
        host_only: bool,
        squared: bool,
    ) -> Reading:
        """The reduced ``head`` vector to its consumer: read now (the step's one host read), or, on the device path,
        handed to the optimizer as its ``found_inf`` flag and copied to a host mirror read at the batch end."""
        reading.path = path
        if host_only or path == "host":
            self.fill(reading, head.tolist(), world, has_loss, has_scale, probes, squared=squared)
            return reading
        if path == "scaler":
            _lightning_compat.or_nonfinite_into_found_inf(scaler, optimizer, head)
        else:
            _lightning_compat.set_found_inf_where_nonfinite(optimizer, head)
        mirror = self._mirrors.get(opt_idx)
        if mirror is None or mirror.size < head.numel():
            mirror = self._mirrors[opt_idx] = HostMirror(max(4, head.numel()), head.device)
        mirror.fill(head)
        reading.pending = (mirror, head.numel(), world, has_loss, has_scale, probes, squared)
        return reading

    def _measure_sharded(
        self,
        trainer: pl.Trainer,
        pl_module: nn.Module,
        optimizer: Optimizer,
        index: ParamIndex,
        norms: GradNorms | None,
        losses: list[Tensor],
        scaler: Any,
        scale: Tensor | None,
        path: str,
        opt_idx: int,
        step: int,
        batch: int,
        host_only: bool,
    ) -> Reading:
        """``measure`` for sharded gradients: squared norms in float64, one SUM all-reduce, sqrt afterwards."""
        device = norms.tensor_norms.device if norms is not None else _first_device(pl_module)
        squares = weighted_squares(index, norms, device)
        loss = _loss_sum(losses)
        head = [squares.sum(), torch.zeros((), device=device) if loss is None else loss]
        if scale is not None:
            head.append(scale)
        maxes = self._buffer_maxes(device) if self._buffers else []
        if maxes:
            head.append(torch.stack(maxes).amax())
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
            optimizer_idx=opt_idx,
            batch=batch,
            grad_norm=math.nan,
            loss=None,
            scale=None,
            has_grads=norms is not None,
            norms=reduced,
            index=index,
            local=local,
        )
        # The step's one host read is the head only; the per-tensor norms stay on the device.
        return self._deliver(
            reading,
            vec[:k],
            optimizer,
            scaler,
            path,
            opt_idx,
            world,
            loss is not None,
            scale is not None,
            int(bool(maxes)),
            host_only=host_only,
            squared=True,
        )

    @staticmethod
    def resolve(reading: Reading) -> bool:
        """Fill a device-path reading from its host mirror. True if it was pending."""
        pending = reading.pending
        if pending is None:
            return False
        reading.pending = None
        mirror, n, world, has_loss, has_scale, probes, squared = pending
        Sensor.fill(reading, mirror.values(n), world, has_loss, has_scale, probes, squared=squared)
        reading.device_skipped = reading.bad
        return True

    @staticmethod
    def fill(
        reading: Reading,
        values: list[float],
        world: int,
        has_loss: bool,
        has_scale: bool,
        probes: int = 0,
        *,
        squared: bool = False,
    ) -> None:
        """Host values from the reduced vector ``[grad norm, loss, (scale), *probes buffer maxes]``, or with
        ``reading.inline`` norms first, ``[norm_0, ..., norm_k-1, loss, ...]`` (the fast path: the total is summed
        here). ``squared``: ``values[0]`` is the global squared norm (sharded)."""
        if reading.inline:
            k = reading.inline
            squares = 0.0
            for v in values[:k]:
                squares += v * v
            values = [math.sqrt(squares), *values[k:]]
        if squared:
            # Already global (shares weighted): no division by the world size. NaN stays NaN; +inf stays +inf.
            values = [math.sqrt(values[0]) if values[0] >= 0 else math.nan, *values[1:]]
            world_norm = 1
        else:
            world_norm = world
        grad_norm, loss = values[0] / world_norm, values[1] / world
        scale = values[2] / world if has_scale else None
        if scale is not None and scale > 0 and math.isfinite(scale):
            loss = loss / scale  # on_before_backward saw the scaled loss
        reading.grad_norm = grad_norm if reading.has_grads else 0.0
        reading.loss = loss if has_loss else None
        reading.scale = scale
        if probes:
            start = 3 if has_scale else 2
            reading.buffers_finite = math.isfinite(sum(values[start : start + probes]))
        if not reading.has_grads and not math.isfinite(values[0]):
            reading.grad_norm = values[0]  # another rank's gradients were non-finite


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
    device = norms.total.device if norms is not None else _first_device_of(index)
    present_flag = torch.tensor(float(norms is not None), dtype=torch.float64, device=device)
    squares = torch.stack([weighted_squares(index, norms, device).sum(), present_flag])
    if trainer.world_size > 1:
        squares = _distributed.sum_across_ranks(trainer, squares)
    total, present = squares.tolist()
    return math.sqrt(total) if present > 0 and total >= 0 else (math.nan if present > 0 else None)


def _first_device_of(index: ParamIndex) -> torch.device:
    return index.params[0].device if index.params else torch.device("cpu")


_FLOAT32 = torch.float32


def _f32(t: Tensor, device: torch.device) -> Tensor:
    """``t`` as float32 on ``device``; itself when it already is (the healthy path: no conversion op)."""
    return t if t.dtype is torch.float32 and t.device == device else t.to(device=device, dtype=torch.float32)


def _loss_sum(losses: list[Tensor]) -> Tensor | None:
    """The step's (micro-batch) losses summed, as ``on_before_backward`` passed them (not detached there: a detach is
    a device op; the reading runs under the optimizer's ``no_grad``, so nothing is recorded; detached here where a
    custom optimizer left grad mode on)."""
    if not losses:
        return None
    if torch.is_grad_enabled():
        losses = [loss.detach() for loss in losses]
    if len(losses) == 1:
        loss = losses[0]
        return loss if loss.dim() == 0 else loss.reshape(())
    return torch.stack([loss.reshape(()).float() for loss in losses]).sum()


def _first_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
