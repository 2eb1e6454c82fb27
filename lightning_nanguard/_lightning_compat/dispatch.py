"""torch internals the origin tracer and the probe's scoring need (never on a healthy step): the dispatch mode that
sees every aten op, the autograd node running now and the forward stack anomaly mode recorded for it, an op's schema
(and the inputs it writes), a tensor's version and storage."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "autograd_node",
    "node_stack",
    "op_is_mutable",
    "storage_key",
    "tensor_version",
    "written_inputs",
]

# Arguments the batch-norm ops write although their schemas do not mark them (``native_batch_norm``'s running
# statistics are updated in place, with no ``(a!)`` and no version bump).
_UNMARKED_WRITES = frozenset({"running_mean", "running_var"})


def autograd_node() -> object:
    """The autograd node running now (``None`` outside the backward)."""
    return torch._C._current_autograd_node()


def node_stack(node: Any) -> list[str]:
    """The forward stack anomaly mode recorded when ``node`` was created (formatted entries, outermost first)."""
    stack = node.metadata.get("traceback_") if node is not None else None
    return list(stack) if isinstance(stack, list) else []


def tensor_version(t: Tensor) -> int:
    """The tensor's in-place version counter (shared by views of one base); -1 for an inference tensor."""
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have none
        return -1


def op_is_mutable(func: Any) -> bool:
    """The aten op writes into one of its inputs (its schema says so)."""
    return bool(func._schema.is_mutable)


def written_inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors ``func`` writes into: the arguments its schema marks as written (``Tensor(a!)``, a list of them,
    ``out=``), and the batch-norm family's running statistics. Empty for an op that writes nothing."""
    schema = func._schema
    out: list[Tensor] = []
    for i, arg in enumerate(schema.arguments):
        alias = arg.alias_info
        if not ((alias is not None and alias.is_write) or arg.name in _UNMARKED_WRITES):
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, Tensor))
    return out


def storage_key(t: Tensor) -> int:
    """The address of the memory a tensor's elements live in (shared by its views); 0 where it has none a write
    could be traced to (an empty tensor, a tensor subclass without storage, a lazy module's uninitialized parameter,
    whose access raises ``ValueError``)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return 0
