"""Find the live tensor each of a snapshot's module entries restores into, where the module has changed since.

A snapshot names every parameter and buffer it holds (``recovery/snapshot_state.py``). A restore matches them by name
to the module as it is now:

* the same name, the same shape, memory order and dtype: the snapshot's values are copied into the live tensor, in
  place (the common case: nothing has changed);
* the same name, another shape (a buffer re-registered at another size since, as a rotary cos/sin cache or an
  attention mask does when a longer sequence arrives): the tensor is **reallocated** at the snapshot's shape and
  the values copied into it; a buffer is re-registered on every module that holds it (``setattr``: it stays
  persistent or not), a parameter keeps its identity (``param.data``: the optimizers still hold it);
* a buffer the snapshot does not hold (registered after it): left as it is (a cache built by a later forward);
  a buffer the module no longer has: nothing to restore;
* a parameter the snapshot does not hold (a lazy module's parameter materialized after it, a parameter added since),
  or one it holds that the module no longer has, or a sharded one (``DTensor``) of another shape: the snapshot
  cannot restore this module (``fits`` is False) and a rollback passes over it.

A sparse entry (``KEPT`` in the layout) is copied in place where the live tensor is a COO tensor (its ``copy_`` takes
any number of values), else reallocated like a reshaped one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_nanguard.recovery.snapshot_layout import TensorSpec
from lightning_nanguard.recovery.snapshot_state import LiveState, empty_like_spec, fits
from lightning_nanguard.signals.sharded import is_sharded

__all__ = ["SnapshotMismatch", "mismatch", "model_targets", "put_kept", "replace_tensor"]


class SnapshotMismatch(RuntimeError):
    """A snapshot was asked to restore a module it cannot (``mismatch`` says why; rollbacks check it first)."""


def mismatch(names: Sequence[str], specs: Sequence[TensorSpec], live: LiveState, module: nn.Module) -> str | None:
    """Why the snapshot whose module entries are ``names``/``specs`` cannot restore ``module`` as ``live`` holds it
    now; ``None`` when it can. Reads names and shapes only (the same on every DDP rank)."""
    held = {n: s for n, s in zip(names, specs, strict=True) if s.kind == "param"}
    now = {n: i for i, (n, s) in enumerate(zip(live.names, live.specs, strict=False)) if s.kind == "param"}
    for name in now:
        if name not in held:
            return f"the parameter {name} did not exist (or was uninitialized) when the snapshot was taken"
    params = dict(module.named_parameters())
    for name, spec in held.items():
        if name not in now:
            return f"the module no longer has the parameter {name}"
        if not fits(live.tensors[now[name]], spec) and is_sharded(params[name]):
            return f"the sharded parameter {name} changed shape"
    return None


def model_targets(
    module: nn.Module, names: Sequence[str], specs: Sequence[TensorSpec], live: LiveState
) -> list[Tensor | None]:
    """The live tensor each of the snapshot's module entries is copied into, reallocated at the snapshot's shape where
    it changed (module docstring); ``None`` where the module no longer has it. Raises ``SnapshotMismatch`` (before
    anything is written) where ``mismatch`` finds a reason."""
    reason = mismatch(names, specs, live, module)
    if reason is not None:
        raise SnapshotMismatch(f"nanguard: this snapshot cannot restore the module: {reason}.")
    where = {n: i for i, n in enumerate(live.names)}
    out: list[Tensor | None] = []
    for name, spec in zip(names, specs, strict=True):
        i = where.get(name)
        if i is None:
            out.append(None)
            continue
        t = live.tensors[i]
        if not fits(t, spec):
            new = empty_like_spec(spec, t.device)
            replace_tensor(module, name, spec.kind, t, new)
            t = new
        out.append(t)
    return out


def put_kept(dst: Tensor, kept: Tensor) -> Tensor | None:
    """Restore a kept (sparse) copy into ``dst`` in place where both are COO tensors (``None``: done); else the copy
    to put where ``dst`` is (on its device) instead."""
    if dst.layout is torch.sparse_coo and kept.layout is torch.sparse_coo:
        dst.copy_(kept)
        return None
    return kept.to(dst.device, copy=True)


def replace_tensor(module: nn.Module, name: str, kind: str, old: Tensor, new: Tensor) -> None:
    """Put ``new`` where the module's parameter or buffer ``name`` (the tensor ``old``) is: a parameter keeps its
    identity (``param.data``), a buffer is re-registered on every module that holds it."""
    if kind == "param":
        module.get_parameter(name).data = new
        return
    for full, buf in module.named_buffers(remove_duplicate=False):
        if buf is old:
            owner, _, leaf = full.rpartition(".")
            setattr(module.get_submodule(owner), leaf, new)
