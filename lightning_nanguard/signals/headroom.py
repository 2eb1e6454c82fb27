"""Precision headroom: how far each module's output is from the largest value its dtype can hold.

``OutputProbe`` watches the modules' outputs for one forward pass at a time: ``arm`` registers a forward hook on each
module, the hooks keep a detached reference to each floating-point output (no device op), ``reduce`` turns them into
one vector of per-module abs-maxima with one fused ``_foreach_norm(ord=inf)`` pass, one ``stack`` and (where a module
ran more than once) one ``scatter_reduce``, and ``disarm`` removes the hooks. Nothing is registered between two
samples, so an unsampled step pays nothing here (on a compiled module the hooks stay, disarmed: ``resident``).
Headroom in bits is ``log2(dtype max / amax)``: float16 holds up to 65504, so an output of 4094 has 4 bits left, and
each doubling of the output spends one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_nanguard._lightning_compat import foreach_norms

__all__ = [
    "GRADIENT",
    "SCALED_GRADIENT",
    "GradProbe",
    "OutputProbe",
    "dtype_max",
    "headroom_bits",
    "scaled_grad_amax",
    "watched_modules",
]

GRADIENT = " (gradient)"  # the suffix of a module's gradient entry: "head (gradient)"
SCALED_GRADIENT = "loss-scaled gradient"  # under 16-mixed: the largest parameter gradient times the loss scale

# Modules that only hold others: their output is a child's (Sequential) or they have no forward of their own.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)
# An output of 0 (or below the dtype's smallest normal number) has this much headroom over the dtype's tiny value.
_FLOOR = 2.0**-24


def _abs_maxes(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Each tensor's largest |value| as one float32 vector (NaN where a tensor holds NaN). On an accelerator one fused
    ``_foreach_norm(ord=inf)``; on a CPU, where that kernel is not vectorized (about 15x slower than ``aminmax`` on
    a 33 MB tensor), one ``aminmax`` per tensor."""
    if device.type != "cpu":
        return torch.stack(foreach_norms(tensors, math.inf, dtypes=(torch.float32,))).float()
    lows, highs = zip(*(torch.aminmax(t) for t in tensors), strict=True)
    return torch.maximum(torch.stack(highs).float(), torch.stack(lows).float().neg())


def dtype_max(dtype: torch.dtype) -> float:
    """The largest finite value of a floating-point ``dtype`` (65504 for float16)."""
    return float(torch.finfo(dtype).max)


def headroom_bits(amax: float, limit: float) -> float:
    """``log2(limit / amax)``: the doublings ``amax`` can still take before it passes ``limit``. ``-inf`` for a
    non-finite ``amax`` (it has overflowed already); an ``amax`` of 0 counts as ``2**-24``."""
    if not math.isfinite(amax):
        return -math.inf
    return math.log2(limit / max(amax, _FLOOR))


def watched_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every submodule of ``root`` whose output is its own (not the root, not a container), by path."""
    return [(name, m) for name, m in root.named_modules() if name and not isinstance(m, _CONTAINERS)]


class OutputProbe:
    """The outputs of ``modules`` during one armed forward pass, reduced to one abs-max per module.

    Args:
        modules: ``(path, module)`` pairs to watch.
        resident: keep the hooks registered between samples, doing nothing while disarmed (for a compiled module:
            torch.compile's graph traced without a hook does not guard on one being added later, so a hook
            registered for one sample would never run; a resident hook's armed flag is guarded instead, and the
            armed and disarmed graphs are both kept: one recompile, then none).
    """

    def __init__(self, modules: Iterable[tuple[str, nn.Module]], *, resident: bool = False) -> None:
        pairs = list(modules)
        self.names = [name for name, _ in pairs]
        self._modules = [m for _, m in pairs]
        self.resident = resident
        self._handles: list[RemovableHandle] = []
        self._on = False
        self._tensors: list[Tensor] = []
        self._slots: list[int] = []  # the module index of each kept tensor
        self.dtypes: dict[int, torch.dtype] = {}  # module index -> the narrowest output dtype seen this sample

    @property
    def armed(self) -> bool:
        return self._on

    def arm(self) -> None:
        """Register a forward hook on every module (until ``disarm``; a resident probe's stay registered)."""
        if self._on:
            return
        self._tensors, self._slots, self.dtypes = [], [], {}
        if not self._handles:
            for i, module in enumerate(self._modules):
                self._handles.append(module.register_forward_hook(self._hook(i)))
        self._on = True

    def disarm(self) -> None:
        self._on = False
        if not self.resident:
            self.release()

    def release(self) -> None:
        """Remove the hooks (a resident probe's too)."""
        self._on = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, slot: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object, output: object) -> None:
            if not self._on or not module.training:
                return  # disarmed (resident), or an evaluation forward: not the training precision's
            if isinstance(output, Tensor):
                self._keep(slot, output)
            elif isinstance(output, (tuple, list)):
                for item in output:
                    if isinstance(item, Tensor):
                        self._keep(slot, item)
            elif isinstance(output, dict):
                for item in output.values():
                    if isinstance(item, Tensor):
                        self._keep(slot, item)

        return hook

    def _keep(self, slot: int, tensor: Tensor) -> None:
        if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.is_sparse:
            return
        self._tensors.append(tensor.detach())
        self._slots.append(slot)
        seen = self.dtypes.get(slot)
        if seen is None or dtype_max(tensor.dtype) < dtype_max(seen):
            self.dtypes[slot] = tensor.dtype

    def reduce(self) -> tuple[Tensor, list[int]] | None:
        """The abs-max of each module seen since ``arm`` (one float32 vector on the first output's device) and the
        indices of those modules, in order; ``None`` when no module produced a floating-point output. Drops the kept
        references."""
        tensors, slots = self._tensors, self._slots
        self._tensors, self._slots = [], []
        if not tensors:
            return None
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            tensors = [t.to(device) for t in tensors]  # the rare model split across devices: one place to reduce
        maxes = _abs_maxes(tensors, device)
        seen = sorted(set(slots))
        if len(seen) == len(slots) and seen == slots:
            return maxes, seen  # every module ran once, in order: the vector is already per module
        position = {slot: i for i, slot in enumerate(seen)}
        index = torch.tensor([position[s] for s in slots], device=device)
        out = torch.zeros(len(seen), device=device).scatter_reduce(0, index, maxes, "amax")
        return out, seen


class GradProbe:
    """The abs-max of each module's parameter gradients (its own parameters, not its submodules'), for a precision
    with no GradScaler to cover them (``16-true``): one reduction over the gradients, one ``scatter_reduce``."""

    def __init__(self, root: nn.Module) -> None:
        slots: dict[str, int] = {}
        self._params: list[nn.Parameter] = []
        self._slots: list[int] = []
        for name, param in root.named_parameters():
            owner = name.rpartition(".")[0] or "(root)"
            self._params.append(param)
            self._slots.append(slots.setdefault(owner, len(slots)))
        self.names = [owner + GRADIENT for owner in slots]

    def reduce(self) -> Tensor | None:
        """One float32 vector, an entry per module (-1 where no gradient), or ``None`` when there is none."""
        pairs = [(p.grad, slot) for p, slot in zip(self._params, self._slots, strict=True) if p.grad is not None]
        grads = [g for g, _ in pairs if g.is_floating_point() and not g.is_sparse and g.numel()]
        if not grads or len(grads) != len(pairs):
            return None
        device = grads[0].device
        if any(g.device != device for g in grads):
            return None
        maxes = _abs_maxes(grads, device)
        index = torch.tensor([slot for _, slot in pairs], device=device)
        return torch.full((len(self.names),), -1.0, device=device).scatter_reduce(0, index, maxes, "amax")


def scaled_grad_amax(grads: list[Tensor], scale: Tensor | None) -> Tensor | None:
    """The largest |value| of ``grads`` times ``scale`` (``None``: they are not unscaled yet), as a 0-d float32
    tensor on their device: the largest value the float16 backward wrote at that loss scale. ``None`` when there is
    no floating-point gradient, or they are spread over devices."""
    grads = [g for g in grads if g.is_floating_point() and not g.is_sparse and g.numel()]
    if not grads:
        return None
    device = grads[0].device
    if any(g.device != device for g in grads):
        return None
    amax = _abs_maxes(grads, device).max()
    return amax if scale is None else amax * scale.to(device=device, dtype=torch.float32)
