"""A replay pass leaves no trace: the buffers it writes are copies, and the RNG, modes and autocast are put back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lightning_nanguard._lightning_compat.metrics import MetricStates

__all__ = ["preserved_attributes", "preserved_state", "swapped"]


@contextlib.contextmanager
def swapped(module: nn.Module, *, float32: bool) -> Iterator[None]:
    """Every buffer (and, with ``float32``, every half-precision parameter) runs on a copy; originals put back."""
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        for b in module.buffers():
            saved.append((b, b.data))
            copy = b.data.to(torch.float32, copy=True) if float32 and b.is_floating_point() else b.data.clone()
            b.data = copy
        if float32:
            for p in module.parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    saved.append((p, p.data))
                    p.data = p.data.float()
        yield
    finally:
        for t, data in reversed(saved):
            t.data = data


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore RNG states, train/eval modes and the autocast state after the block, whatever it did."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    modes = [(m, m.training) for m in module.modules()]
    autocast = {d: torch.is_autocast_enabled(d) for d in ("cpu", "cuda")}
    grad_enabled = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, training in modes:
            m.training = training
        for d, enabled in autocast.items():
            if torch.is_autocast_enabled(d) != enabled:
                torch.set_autocast_enabled(d, enabled)
        torch.set_grad_enabled(grad_enabled)


# The attributes nn.Module keeps for itself (parameters, buffers, children, hooks): never put back by hand.
_MODULE_OWN = frozenset(vars(nn.Module()))


@contextlib.contextmanager
def preserved_attributes(module: nn.Module) -> Iterator[None]:
    """Put back what a ``training_step`` called outside training changes in the module's own Python state: every
    module's plain attributes (a counter rebound, a list appended to, a dict or set filled, an attribute added) and
    its torchmetrics states. A tensor attribute changed in place (not a buffer, not a metric's) is not undone."""
    metrics = MetricStates(module)
    saved_metrics = metrics.save() if metrics else None
    saved: list[tuple[nn.Module, dict[str, object], dict[str, list[object] | dict[object, object] | set[object]]]] = []
    for m in module.modules():
        attrs = {k: v for k, v in vars(m).items() if k not in _MODULE_OWN}
        contents: dict[str, list[object] | dict[object, object] | set[object]] = {}
        for k, v in attrs.items():
            if type(v) is list:
                contents[k] = list(v)
            elif type(v) is dict:
                contents[k] = dict(v)
            elif type(v) is set:
                contents[k] = set(v)
        saved.append((m, attrs, contents))
    try:
        yield
    finally:
        for m, attrs, contents in saved:
            own = vars(m)
            for k in [k for k in own if k not in _MODULE_OWN and k not in attrs]:
                del own[k]
            for k, v in attrs.items():
                own[k] = v
                kept = contents.get(k)
                if isinstance(v, list) and isinstance(kept, list):
                    v[:] = kept
                elif isinstance(v, dict) and isinstance(kept, dict):
                    v.clear()
                    v.update(kept)
                elif isinstance(v, set) and isinstance(kept, set):
                    v.clear()
                    v |= kept
        if saved_metrics is not None:
            MetricStates.restore(saved_metrics)
