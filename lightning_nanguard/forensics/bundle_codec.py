"""Values a bundle stores, as what ``torch.load(weights_only=True)`` reads back: tensors, primitives, lists, tuples and
dicts. A named tuple, a ``torch.dtype``, ``torch.device``, ``torch.layout`` or ``torch.memory_format`` becomes a
tagged dict.

Decoding is data only: ``decode`` builds nothing but tensors, numbers, strings, bytes, ``None``, lists, tuples,
dicts, the torch dtypes, devices, layouts and memory formats it knows, and named tuples of its own making (the
recorded type name and fields, never the recorded class: nothing a file names is imported or called). Anything else
(an unknown tag, a value of another type, a malformed tagged dict) raises ``Undecodable``.
"""

from __future__ import annotations

import collections
import keyword
import random
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch
from torch import Tensor

from lightning_nanguard.exceptions import brief

__all__ = [
    "Undecodable",
    "Unencodable",
    "capture_rng",
    "check_rng",
    "decode",
    "encode",
    "nbytes",
    "restore_rng",
    "to_device",
]

_TAG = "__nanguard__"
_PRIMITIVES = (str, bytes, int, float, bool, type(None))
_ENUMS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


class Unencodable(TypeError):
    """A value no weights-only load can read back (an arbitrary object)."""


class Undecodable(ValueError):
    """A stored value outside the fixed set ``decode`` builds (an unknown tag, another type, a malformed entry)."""


def encode(obj: object, *, to_cpu: bool = True) -> Any:
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
    if isinstance(obj, torch.Size):
        return obj
    if isinstance(obj, (list, tuple)):
        return (list if isinstance(obj, list) else tuple)(encode(v, to_cpu=to_cpu) for v in obj)
    if isinstance(obj, Mapping) and all(isinstance(k, (str, int)) for k in obj) and _TAG not in obj:
        return {k: encode(v, to_cpu=to_cpu) for k, v in obj.items()}
    raise Unencodable(f"{type(obj).__module__}.{type(obj).__qualname__}")


def decode(obj: object) -> Any:
    """The inverse of ``encode``, from the fixed set of plain types only (``Undecodable`` otherwise). A named tuple
    comes back as a named tuple with the recorded type name and fields, made here (not the recorded class)."""
    if isinstance(obj, Tensor):
        return obj
    if isinstance(obj, bool | int | float | str | bytes | None | torch.Size):
        return obj
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(decode(v) for v in obj)
    if isinstance(obj, dict):
        if _TAG in obj:
            return _tagged(obj)
        if not all(isinstance(k, str | int) for k in obj):
            raise Undecodable(f"holds a dict keyed by {sorted({type(k).__name__ for k in obj})}: only str and int keys")
        return {k: decode(v) for k, v in obj.items()}
    raise Undecodable(f"holds a {type(obj).__module__}.{type(obj).__qualname__}, not one of the plain types")


def _tagged(obj: dict[Any, Any]) -> Any:
    tag = obj[_TAG]
    value = obj.get("value")
    if tag in _ENUMS and set(obj) == {_TAG, "value"} and isinstance(value, str) and value.isidentifier():
        found = getattr(torch, value, None)
        if isinstance(found, _ENUMS[tag]):
            return found
        raise Undecodable(f"holds {brief(value)}, which is no torch {tag}")
    if tag == "device" and set(obj) == {_TAG, "value"} and isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError as err:
            raise Undecodable(f"holds {brief(value)}, which is no torch device") from err
    if tag == "namedtuple" and set(obj) == {_TAG, "type", "fields"}:
        kind, fields = obj["type"], obj["fields"]
        if not isinstance(kind, str) or not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
            raise Undecodable("holds a malformed named tuple")
        return _namedtuple(kind.rpartition(":")[2].rpartition(".")[2], tuple(fields))(
            *(decode(v) for v in fields.values())
        )
    raise Undecodable(f"holds an unknown tagged value {str(tag)[:40]!r} (keys {sorted(map(str, obj))[:6]})")


@cache
def _namedtuple(name: str, fields: tuple[str, ...]) -> Any:
    """A named tuple type made here from the recorded name and fields (identifiers only)."""
    names = (name, *fields)
    if not all(n.isidentifier() and not keyword.iskeyword(n) and not n.startswith("_") for n in names):
        raise Undecodable(f"holds a named tuple {name[:40]!r} with fields {list(fields)[:8]}: not plain identifiers")
    return collections.namedtuple(name, fields)


def to_device(obj: object, device: torch.device | str) -> Any:
    """``obj`` (as ``decode`` returns it) with every tensor on ``device``, named tuples kept."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def nbytes(obj: object) -> int:
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

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


def _byte_tensor(t: object) -> bool:
    return isinstance(t, Tensor) and t.dtype == torch.uint8 and t.dim() == 1


def check_rng(state: object) -> None:
    """Raise ``Undecodable`` unless ``state`` has the shape ``capture_rng`` gives (so ``restore_rng`` cannot fail
    half-way on a damaged bundle)."""
    if not isinstance(state, dict) or not _byte_tensor(state.get("torch")):
        raise Undecodable("the random states lack the torch generator's (a uint8 tensor)")
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(_byte_tensor(t) for t in cuda):
        raise Undecodable("the CUDA random states are not uint8 tensors")
    python = state.get("python")
    if python is not None:
        ok = isinstance(python, list) and len(python) == 3 and isinstance(python[1], list)
        if not ok or not all(isinstance(v, int) for v in python[1]):
            raise Undecodable("the Python random state is malformed")
        try:
            random.Random().setstate((python[0], tuple(python[1]), python[2]))
        except (TypeError, ValueError) as err:
            raise Undecodable(f"the Python random state is malformed: {err}") from err
    numpy = state.get("numpy")
    if numpy is not None and not (
        isinstance(numpy, list) and len(numpy) == 5 and isinstance(numpy[0], str) and isinstance(numpy[1], Tensor)
    ):
        raise Undecodable("the NumPy random state is malformed")


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
