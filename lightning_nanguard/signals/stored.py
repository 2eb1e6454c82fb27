"""What a check reads of a tensor of the training state, whatever kind of tensor it is.

The finiteness checks and norms read dense tensors with fused kernels (``torch._foreach_norm``), which take neither a
sparse tensor nor an uninitialized parameter. Every check of a parameter, buffer or optimizer-state tensor reads it
through ``stored_values``:

* a sharded tensor (``DTensor``): this rank's local shard (``signals/sharded.py``);
* a sparse tensor (COO, CSR, CSC, BSR, BSC: a graph's adjacency registered as a buffer, the momentum SGD keeps for a
  sparse gradient): the dense tensor of the values it stores (the elements it does not store are zeros, finite);
* a complex tensor: its real view (a complex NaN is a NaN in its real or imaginary part);
* a parameter or buffer of a lazy module before its first forward (``nn.LazyLinear``): nothing (``None``). It holds
  no value yet; once the forward has materialized it, it is an ordinary tensor and is checked as one.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from lightning_nanguard import _lightning_compat
from lightning_nanguard.signals.sharded import local_tensor

__all__ = ["is_uninitialized", "stored_values"]


def is_uninitialized(t: Tensor) -> bool:
    """``t`` is a lazy module's parameter or buffer that no forward has materialized yet (it has no shape)."""
    return is_lazy(t)


def stored_values(t: Tensor) -> Tensor | None:
    """The dense tensor a check reads for ``t`` (module docstring); ``None`` for an uninitialized (lazy) tensor."""
    if is_lazy(t):
        return None
    t = local_tensor(t)
    if t.layout is not torch.strided:
        t = _lightning_compat.stored_values(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t
