"""Values a bundle stores, as what ``torch.load(weights_only=True)`` reads back: tensors, primitives, lists, tuples and
dicts. A named tuple, a ``torch.dtype`` or a ``torch.device`` becomes a tagged dict and comes back as itself."""

from __future__ import annotations

import importlib
import random
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["Unencodable", "capture_rng", "decode", "encode", "nbytes", "restore_rng"]

_TAG = "__nanguard__"
_PRIMITIVES = (str, int, float, bool, type(None))


class Unencodable(TypeError):
    """A value no weights-only load can read back (an arbitrary object)."""


def encode(obj: Any, *, to_cpu: bool = True) -> Any:
    """``obj`` with tensors detached (and on the CPU) and every non-primitive container tagged."""
    if isinstance(obj, Tensor):
        t = obj.detach()
        return t.cpu().clone() if to_cpu else t.clone()
    if isinstance(obj, _PRIMITIVES):
        return obj
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "value": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {_TAG: "device", "value": str(obj)}
    if isinstance(obj, (torch.layout, torch.memory_format)):
        return {_TAG: type(obj).__name__, "value": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        kind = type(obj)
        fields = {k: encode(v, to_cpu=to_cpu) for k, v in zip(obj._fields, obj, strict=True)}
        return {_TAG: "namedtuple", "type": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    if isinstance(obj, (list, tuple)):
        return type(obj)(encode(v, to_cpu=to_cpu) for v in obj)
    if isinstance(obj, Mapping) and all(isinstance(k, (str, int)) for k in obj):
        return {k: encode(v, to_cpu=to_cpu) for k, v in obj.items()}
    raise Unencodable(f"{type(obj).__module__}.{type(obj).__qualname__}")


def decode(obj: Any, device: torch.device | str | None = None) -> Any:
    """The inverse of ``encode``, with tensors moved to ``device`` (kept where they are when ``None``)."""
    if isinstance(obj, Tensor):
        return obj.to(device) if device is not None else obj
    if isinstance(obj, list):
        return [decode(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode(v, device) for v in obj)
    if isinstance(obj, dict):
        tag = obj.get(_TAG)
        if tag == "dtype":
            return getattr(torch, obj["value"])
        if tag == "device":
            return torch.device(obj["value"]) if device is None else torch.device(device)
        if tag in ("layout", "memory_format"):
            return getattr(torch, obj["value"])
        if tag == "namedtuple":
            module, _, qualname = obj["type"].partition(":")
            kind: Any = importlib.import_module(module)
            for part in qualname.split("."):
                kind = getattr(kind, part)
            return kind(**{k: decode(v, device) for k, v in obj["fields"].items()})
        return {k: decode(v, device) for k, v in obj.items()}
    return obj


def nbytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj``."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def capture_rng() -> dict[str, Any]:
    """The torch (CPU, and CUDA once initialised), Python and NumPy random states, weights-only loadable."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
        state["numpy"] = [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the random states ``capture_rng`` took (CUDA only where this machine has the same devices)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
