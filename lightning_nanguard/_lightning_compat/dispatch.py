"""torch internals the origin tracer needs (incident path only): the dispatch mode that sees every aten op, the
autograd node running now and the forward stack anomaly mode recorded for it, an op's schema, a tensor's version."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode", "autograd_node", "node_stack", "op_is_mutable", "tensor_version"]


def autograd_node() -> Any:
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
