"""A scoring leaves no trace: what the module can reach is recorded before the call and put back after it.

A probe scoring calls the user's own ``training_step``, which may do anything a training step does: update an EMA
kept in plain tensors or in an ``AveragedModel``, append to a list, count, draw from a generator of its own, update a
torchmetrics metric. ``untouched(module)`` finds all of it by one walk, not by a list of types: every module of the
tree and, from each module's attributes, whatever can be reached through containers (``list``, ``dict``, ``set``,
``tuple``, ``deque``, ``bytearray``) and plain objects' attributes, to ``MAX_DEPTH`` levels and ``MAX_NODES``
objects. What it finds is kept as follows, and put back when the call returns (or raises):

* **tensors** (parameters, tensors held in attributes and inside containers): the first write into each one during
  the call, seen by a dispatch mode from the op's schema (``_lightning_compat.written_inputs``), copies it before it
  is written; the copy is written back afterwards. Nothing is copied that the call does not write. A write that
  bypasses the dispatcher but moves the tensor's version counter is found afterwards and cannot be undone;
* **buffers** run on copies for the call (``forensics.isolation.swapped``, the caller's): not written at all;
* **containers and objects' attributes**: their contents (a shallow copy) put back where the call changed them, in
  the same objects (references elsewhere stay valid); an attribute the call added is removed;
* **random generators** (anything with ``get_state``/``set_state`` or ``getstate``/``setstate``: a
  ``torch.Generator``, ``random.Random``, NumPy's ``RandomState``; a NumPy ``Generator``'s bit generator): their
  state put back. The global streams are the caller's (``forensics.isolation.preserved_state``);
* **NumPy arrays**: a copy, written back where they changed;
* **anything else** that pickles: its pickle compared before and after; a change cannot be undone.

What cannot be undone is reported (``Trace.beyond_repair``: where it was reached from), so the caller stops scoring.
A compiled module runs eagerly for the call (its graphs would hide their ops from the dispatch mode). Not walked: the
Trainer and Lightning's own objects (the loop's state is not the module's), loggers, and what lies past the bounds; a
write to a file or a socket is not seen.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from lightning_nanguard import _lightning_compat

try:
    import numpy as np
except ImportError:  # pragma: no cover - torch installs it
    np = None  # type: ignore[assignment]

__all__ = ["MAX_DEPTH", "MAX_NODES", "Trace", "host_rngs_kept", "untouched"]

MAX_DEPTH = 8  # attribute/container levels below a module walked (a dict of lists of tensors is 3)
MAX_NODES = 200_000  # objects visited in all (a list of 100k step losses is walked whole)
MAX_PICKLE = 1 << 20  # bytes of an opaque object's pickle compared (a larger one is not compared)

# Attributes nn.Module keeps for itself (parameters, buffers, children, hooks): walked through, never put back.
_MODULE_OWN = frozenset(vars(nn.Module()))
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range, slice, torch.dtype, torch.device, type)
_CALLABLE = (FunctionType, BuiltinFunctionType, MethodType, ModuleType)
# Objects of these packages are infrastructure, not the module's state: the Trainer and its loops, Lightning's own
# objects, loggers and the multiprocessing/threading machinery.
_NOT_STATE = (
    "lightning.",
    "lightning_fabric.",
    "pytorch_lightning.",
    "lightning_nanguard.",
    "logging",
    "threading",
    "multiprocessing",
    "_thread",
    "io",
    "_io",
    "socket",
    "wandb",
    "tensorboard",
    "mlflow",
    "comet_ml",
)


@dataclass
class Trace:
    """What one call changed that could not be put back (empty: nothing)."""

    beyond_repair: list[str] = field(default_factory=list)


class _Reach:
    """Everything reachable from one module, recorded (``walk``), compared and put back (``restore``)."""

    def __init__(self, root: nn.Module) -> None:
        self.seen: set[int] = set()
        self.nodes = 0
        self.buffers = {id(b) for b in root.buffers()}
        self.tensors: list[tuple[str, Tensor, int]] = []  # (where, tensor, version)
        self.contents: list[tuple[Any, Any]] = []  # (container, shallow copy)
        self.attributes: list[tuple[object, dict[str, Any], bool]] = []  # (object, its attributes, is a module)
        self.states: list[tuple[str, Any, Any]] = []  # (where, generator, state)
        self.arrays: list[tuple[Any, Any]] = []  # (array, copy)
        self.pickles: list[tuple[str, Any, bytes]] = []
        self._visit(root, type(root).__name__, 0)

    # ------------------------------------------------------------------ walk
    def _visit(self, obj: object, where: str, depth: int) -> None:
        if isinstance(obj, (_IMMUTABLE, _CALLABLE)) or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            return
        if isinstance(obj, Tensor):
            if id(obj) not in self.buffers:
                self.tensors.append((where, obj, _lightning_compat.tensor_version(obj)))
            return
        if isinstance(obj, nn.Module):
            self._visit_module(obj, where, depth)
            return
        if _is_infrastructure(obj):
            return
        if isinstance(obj, (list, collections.deque)):
            self.contents.append((obj, list(obj)))
            for i, v in enumerate(obj):
                self._visit(v, f"{where}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            self.contents.append((obj, dict(obj)))
            for k, v in obj.items():
                self._visit(v, f"{where}[{_key(k)}]", depth + 1)
        elif isinstance(obj, set):
            self.contents.append((obj, set(obj)))
        elif isinstance(obj, bytearray):
            self.contents.append((obj, bytes(obj)))
        elif isinstance(obj, (tuple, frozenset)):
            for i, v in enumerate(obj):
                self._visit(v, f"{where}[{i}]", depth + 1)
        elif (state := _get_state(obj)) is not None:
            self.states.append((where, obj, state))
        elif np is not None and isinstance(obj, np.ndarray):
            self.arrays.append((obj, obj.copy()))
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            attrs = dict(vars(obj))
            self.attributes.append((obj, attrs, False))
            for k, v in attrs.items():
                self._visit(v, f"{where}.{k}", depth + 1)
        else:
            self._fingerprint(obj, where)

    def _visit_module(self, module: nn.Module, where: str, depth: int) -> None:
        attrs = {k: v for k, v in vars(module).items() if k not in _MODULE_OWN}
        self.attributes.append((module, attrs, True))
        for k, v in attrs.items():
            self._visit(v, f"{where}.{k}", depth + 1)
        for name, p in module.named_parameters(recurse=False):
            self._visit(p, f"{where}.{name}", depth + 1)
        for name, child in module.named_children():
            self._visit(child, f"{where}.{name}", depth)  # the module tree is walked whole, whatever its depth

    def _fingerprint(self, obj: object, where: str) -> None:
        try:
            data = pickle.dumps(obj)
        except Exception:  # not picklable: a change to it cannot be seen (the module docstring says so)
            return
        if len(data) <= MAX_PICKLE:
            self.pickles.append((where, obj, data))

    # ------------------------------------------------------------------ after the call
    def tracked(self) -> list[Tensor]:
        return [t for _, t, _ in self.tensors]

    def restore(self, written: set[int]) -> list[str]:
        """Put back what the call changed; return where it changed what cannot be put back. ``written``: the ids of
        the tensors whose first write was copied (they are written back by the caller)."""
        lost = [
            where
            for where, t, version in self.tensors
            if id(t) not in written and version >= 0 and _lightning_compat.tensor_version(t) != version
        ]
        for obj, attrs, module in self.attributes:
            own = vars(obj)
            if module:
                for k in [k for k in own if k not in _MODULE_OWN and k not in attrs]:
                    del own[k]
            elif own.keys() != attrs.keys():
                own.clear()
            for k, v in attrs.items():
                if own.get(k, _MISSING) is not v:
                    own[k] = v
        for obj, saved in self.contents:
            _put_back(obj, saved)
        for where, gen, state in self.states:
            try:
                _set_state(gen, state)
            except Exception:
                lost.append(where)
        for arr, saved in self.arrays:
            if not np.array_equal(arr, saved, equal_nan=saved.dtype.kind in "fc"):
                arr[...] = saved
        for where, obj, data in self.pickles:
            with contextlib.suppress(Exception):
                if pickle.dumps(obj) != data:
                    lost.append(where)
        return lost


_MISSING = object()


def _key(k: object) -> str:
    return repr(k) if isinstance(k, (str, int)) else type(k).__name__


def _is_infrastructure(obj: object) -> bool:
    module = type(obj).__module__ or ""
    return module.startswith(_NOT_STATE) and not isinstance(obj, (list, dict, set, tuple))


def _get_state(obj: object) -> Any:
    """A random generator's state (``None``: not a generator)."""
    for get in ("get_state", "getstate"):
        if callable(getattr(type(obj), get, None)) and callable(getattr(type(obj), "s" + get[1:], None)):
            return getattr(obj, get)()
    bit = getattr(obj, "bit_generator", None)  # NumPy's Generator
    if bit is not None and hasattr(bit, "state"):
        return bit.state
    return None


def _set_state(obj: Any, state: Any) -> None:
    for get in ("get_state", "getstate"):
        if callable(getattr(type(obj), get, None)):
            getattr(obj, "s" + get[1:])(state)
            return
    obj.bit_generator.state = state


def _put_back(obj: Any, saved: Any) -> None:
    """``obj``'s contents as ``saved`` (a shallow copy), in place, where they differ."""
    if isinstance(obj, dict):
        if obj.keys() != saved.keys() or any(obj[k] is not v for k, v in saved.items()):
            obj.clear()
            obj.update(saved)
    elif isinstance(obj, set):
        if obj != saved:
            obj.clear()
            obj.update(saved)
    elif isinstance(obj, bytearray):
        if obj != saved:
            obj[:] = saved
    elif len(obj) != len(saved) or any(a is not b for a, b in zip(obj, saved, strict=False)):
        if isinstance(obj, collections.deque):
            obj.clear()
            obj.extend(saved)
        else:
            obj[:] = saved


class _FirstWrites(_lightning_compat.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Copies each tracked tensor the first time an op writes into its memory (before the write)."""

    def __init__(self, tensors: list[Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.by_storage: dict[int, list[Tensor]] = {}
        for t in tensors:
            key = _lightning_compat.storage_key(t)
            if key:
                self.by_storage.setdefault(key, []).append(t)
        self.originals: dict[int, tuple[Tensor, Tensor]] = {}  # id -> (tensor, copy before the first write)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.by_storage:
            for target in _lightning_compat.written_inputs(func, args, kwargs):
                for t in self.by_storage.get(_lightning_compat.storage_key(target), ()):
                    if id(t) not in self.originals:
                        self.originals[id(t)] = (t, t.detach().clone())
        return func(*args, **kwargs)

    @torch.no_grad()
    def write_back(self) -> None:
        for t, copy in self.originals.values():
            t.detach().copy_(copy)


@contextlib.contextmanager
def untouched(module: nn.Module) -> Iterator[Trace]:
    """Run the block, then put back everything ``module`` can reach as it was before it (the module docstring).
    The yielded ``Trace`` names, after the block, what could not be put back."""
    reach = _Reach(module)
    writes = _FirstWrites(reach.tracked())
    trace = Trace()
    try:
        # Eager for the block: a compiled module's graphs would hide their ops from the dispatch mode (and be
        # recompiled for it).
        with torch.compiler.set_stance("force_eager"), writes:
            yield trace
    finally:
        trace.beyond_repair = reach.restore(set(writes.originals))
        writes.write_back()


@contextlib.contextmanager
def host_rngs_kept(seed: int | None = None) -> Iterator[None]:
    """Python's and NumPy's global RNG states put back after the block (both seeded with ``seed`` for it, if given):
    a training_step that draws from them leaves the training streams where they were."""
    state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    try:
        if seed is not None:
            random.seed(seed)
            if np is not None:
                np.random.seed(seed)
        yield
    finally:
        random.setstate(state)
        if np is not None and np_state is not None:
            np.random.set_state(np_state)
