"""Per-op headroom: every half-precision op one forward runs, its largest value against the dtype's, by module.

A module's output can keep ample headroom while a value computed inside its forward overflows (attention logits fed
to a hand-written ``exp``, ``z * std`` in a de-normalising head). ``OpProbe`` sees those values: while armed, a
dispatch mode sees every aten op the forward runs (below autocast, so with the dtypes it really runs in) and forward
pre/post hooks keep the stack of modules running, so each op is attributed to the innermost watched module. Per op
whose output is half precision (float16, bfloat16), one ``aminmax`` on the device; nothing is read on the host here.

``reduce`` turns the kept values into one *fraction of the limit* per op (headroom in bits is ``-log2`` of it):

* the output's abs-max over its dtype's max (float16: 65504; an output of 4094 is 1/16: 4 bits left);
* for an op whose input is the hazard (``exp``-like: the output is ``e**x``), the largest input over the dtype's
  log-max (float16: ``log(65504)`` = 11.09; an ``exp`` of logits up to 5.5 has 1 bit left: one more doubling of its
  input overflows). A logit scale that grows by a factor per step spends the same bits per step, which the forecast's
  linear trend follows; the output's fraction (``e**(x - 11.09)``) is always the smaller one, and reaches 1 only at
  the overflow;
* in a forward tried before its step (``arm(overflows=True)``), an output that is non-finite in at least half its
  rows although every tensor input was finite and no non-finite scalar was passed (``masked_fill(mask, -inf)`` is a
  value, not an overflow): ``OVERFLOWED`` (-64 bits). An overflow on a sampled step has happened (the incident path
  answers it), and one in a few rows of the batch is bad data's (the incident path's too): not measured;
* any other non-finite output (propagated from an input that was): -1, not measured.

and one entry per module, the worst of its ops (``-1`` where none ran), with the index of that op. View ops are not
measured (their values are their input's); an op outside every watched module (the loss in ``training_step``) is not
attributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_nanguard._lightning_compat import TorchDispatchMode

__all__ = ["HAZARDS", "OPS", "OVERFLOWED", "OpProbe", "OpReading", "module_of"]

OPS = " (ops)"  # the suffix of a module's per-op entry in the headroom book: "blocks.0.attn (ops)"

OVERFLOWED = 2.0**64  # the fraction of the limit of an op that overflowed its dtype: -64 bits
OVERFLOW_ROWS = 0.5  # an overflow in this share of an op's rows or more is the model's, not a few bad rows'

# The ops whose input is the hazard: op name -> (which input, what its largest value makes of the output).
HAZARDS: dict[str, str] = {
    "aten.exp": "exp",
    "aten.exp_": "exp",
    "aten.expm1": "exp",
    "aten.exp2": "exp2",
    "aten.cosh": "cosh",
    "aten.sinh": "cosh",
}
_HALF = (torch.float16, torch.bfloat16)


class OpReading:
    """What one armed forward saw: per-op device scalars and their bookkeeping, reduced by ``OpProbe.reduce``."""

    def __init__(self) -> None:
        self.names: list[str] = []  # per op: "aten.mul"
        self.slots: list[int] = []  # per op: the innermost watched module that ran it
        self.lows: list[Tensor] = []  # per op: its output's min and max (``aminmax``, the output's dtype)
        self.highs: list[Tensor] = []
        self.limits: list[float] = []  # per op: its output dtype's max
        self.hazard: dict[int, Tensor] = {}  # op -> its input's fraction of the dtype's log-max (exp-like ops)
        self.inputs: list[tuple[int, int]] = []  # (op, source) per tensor input: source >= 0 an op, < 0 a leaf
        self.leaf_lows: list[Tensor] = []  # per leaf input (an input no measured op made): its min and max
        self.leaf_highs: list[Tensor] = []
        self.scalar_nonfinite: list[bool] = []  # per op: a non-finite Python scalar was passed (a fill value)
        self.bad_rows: list[Tensor] = []  # per op, where overflows are judged: the share of its rows not finite


class OpProbe:
    """The half-precision ops of one armed forward pass, attributed to ``modules``, reduced to an abs-max per module.

    Args:
        modules: ``(path, module)`` pairs; their positions are the slots of ``reduce``'s per-module vector.
        dtypes: the output dtypes measured (half precision; a benchmark passes float32 to time the same work on a
            float32 forward).
    """

    def __init__(self, modules: Iterable[tuple[str, nn.Module]], dtypes: tuple[torch.dtype, ...] = _HALF) -> None:
        self.dtypes = dtypes
        pairs = list(modules)
        self.names = [name for name, _ in pairs]
        self._modules = [m for _, m in pairs]
        self._handles: list[RemovableHandle] = []
        self._stack: list[int] = []
        self._mode: _Mode | None = None
        self.reading = OpReading()
        self.last_ops: list[str] = []  # the op names of the last ``reduce``, by index
        self._ops: dict[Any, str] = {}  # aten op -> its name ("" for a view op)
        self._overflows = False
        self._limits: dict[torch.dtype, float] = {}
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a tensor seen -> its source (``_source``)

    @property
    def armed(self) -> bool:
        return self._mode is not None

    def arm(self, *, overflows: bool = False) -> None:
        """Register the modules' pre/post forward hooks and enter the dispatch mode (until ``disarm``).

        Args:
            overflows: judge an op that overflowed (a forward tried before its step runs): ``OVERFLOWED`` where its
                output is non-finite in at least ``OVERFLOW_ROWS`` of its rows (leading dimension), one more
                reduction per op. Otherwise (a sampled step: the step has overflowed already, which the incident
                path answers) and where fewer rows overflow (a few bad rows of the batch, which is the data's
                cause, not the precision's), the op is not measured.
        """
        if self._mode is not None:
            return
        self.reading, self._stack, self._made = OpReading(), [], WeakIdKeyDictionary()
        self._overflows = overflows
        for i, module in enumerate(self._modules):
            self._handles.append(module.register_forward_pre_hook(self._enter(i)))
            self._handles.append(module.register_forward_hook(self._leave(i), always_call=True))
        self._mode = _Mode(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]

    def disarm(self) -> None:
        """Leave the dispatch mode and remove the hooks (the kept values stay for ``reduce``)."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack = [], []
        self._made = WeakIdKeyDictionary()

    def _enter(self, slot: int) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            self._stack.append(slot)

        return hook

    def _leave(self, slot: int) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self._stack and self._stack[-1] == slot:
                self._stack.pop()

        return hook

    def see(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """One op ran (called by the dispatch mode, with modes off): keep its output's extremes on the device (one
        ``aminmax``; one more per input no measured op made)."""
        if not self._stack or not isinstance(out, Tensor) or out.dtype not in self.dtypes or not out.numel():
            return
        known = self._ops.get(func)
        if known is None:
            known = self._ops[func] = "" if func.is_view else str(func.overloadpacket)
        if not known:
            return  # a view: its values are its input's
        values = (*args, *kwargs.values())
        ins = [a for a in values if isinstance(a, Tensor) and a.is_floating_point()]
        if known == "aten._to_copy" and all(isinstance(t, nn.Parameter) for t in ins):
            return  # autocast's cast of a weight: a weight past the half range shows in its module's output
        r = self.reading
        op = len(r.names)
        for t in ins:
            source = self._source(t)
            if source is not None:
                r.inputs.append((op, source))
        lo, hi = torch.aminmax(out.detach())
        self._made[out] = op
        r.names.append(known)
        r.slots.append(self._stack[-1])
        r.lows.append(lo)
        r.highs.append(hi)
        limit = self._limits.get(out.dtype)
        if limit is None:
            limit = self._limits[out.dtype] = float(torch.finfo(out.dtype).max)
        r.limits.append(limit)
        r.scalar_nonfinite.append(any(isinstance(a, float) and not math.isfinite(a) for a in values))
        if self._overflows:
            bad = ~out.detach().isfinite()
            r.bad_rows.append(bad.reshape(out.shape[0], -1).any(1).float().mean() if out.dim() else bad.float())
        kind = HAZARDS.get(known)
        if kind is not None and ins:
            r.hazard[op] = _hazard(kind, ins[0], limit)

    def _source(self, t: Tensor) -> int | None:
        """Where an input's finiteness is read: the measured op that made it (>= 0), or a leaf's ``aminmax`` (< 0,
        one per input no measured op made: a buffer, a batch field, a float32 op's output, cached for the pass);
        ``None`` for a parameter (the suite checks the parameters at every step) or an empty tensor."""
        made = self._made.get(t)  # type: ignore[no-untyped-call]
        if made is not None:
            return int(made)
        if not t.numel() or isinstance(t, nn.Parameter):
            return None
        r = self.reading
        lo, hi = torch.aminmax(t.detach())
        r.leaf_lows.append(lo)
        r.leaf_highs.append(hi)
        leaf = -len(r.leaf_lows)
        self._made[t] = leaf
        return leaf

    def reduce(self) -> Tensor | None:
        """One float32 vector on the device, two entries per module: the largest fraction of the limit of its ops
        (-1 where none ran; the module docstring says how each is made), then the index of that op in ``last_ops``
        (-1: none). ``None`` when no half-precision op was attributed. Drops the kept values."""
        r, self.reading = self.reading, OpReading()
        self._made = WeakIdKeyDictionary()
        if not r.names:
            return None
        device = r.highs[0].device
        lows, highs = _stacked(r.lows, device), _stacked(r.highs, device)
        out = torch.maximum(highs, lows.neg()) / _to(device, r.limits)
        finite = lows.isfinite() & highs.isfinite()
        made_here = ~_to(device, r.scalar_nonfinite)
        if r.bad_rows:  # an overflow of most rows: the model, not a few bad rows of the batch
            made_here = made_here & (torch.stack(r.bad_rows).to(device) >= OVERFLOW_ROWS)
        else:
            made_here = torch.zeros_like(made_here)
        if r.inputs:  # every input finite: an op's own output, or a leaf's extremes
            leaves = (
                _stacked(r.leaf_lows, device).isfinite() & _stacked(r.leaf_highs, device).isfinite()
                if r.leaf_lows
                else torch.zeros(0, dtype=torch.bool, device=device)
            )
            sources = torch.cat([finite, leaves])  # leaf -k (the k-th) at n_ops + k - 1
            n_ops = len(r.names)
            index = _to(device, [s if s >= 0 else n_ops - s - 1 for _, s in r.inputs])
            owner = _to(device, [o for o, _ in r.inputs])
            ok = torch.ones(n_ops, device=device).scatter_reduce(0, owner, sources[index].float(), "amin")
            made_here = made_here & ok.bool()
        value = torch.where(finite & out.isfinite(), out, torch.where(made_here, OVERFLOWED, -1.0))
        if r.hazard:
            index = _to(device, list(r.hazard))
            hazard = torch.stack(list(r.hazard.values())).to(device)
            hazard = torch.where(hazard.isfinite(), hazard, -1.0)  # a non-finite input came from elsewhere
            value = value.scatter_reduce(0, index, hazard, "amax")
        slots = _to(device, r.slots)
        n = len(self.names)
        per_module = torch.full((n,), -1.0, device=device).scatter_reduce(0, slots, value, "amax")
        index = torch.arange(len(r.names), device=device, dtype=torch.float32)
        candidate = torch.where(value == per_module[slots], index, -1.0)  # no boolean indexing: no device sync
        worst = torch.full((n,), -1.0, device=device).scatter_reduce(0, slots, candidate, "amax")
        self.last_ops = list(r.names)
        return torch.cat([per_module, worst])


def _to(device: torch.device, values: list[Any]) -> Tensor:
    """A host list as a device tensor, copied without waiting for the device's queue (``non_blocking``)."""
    return torch.tensor(values).to(device, non_blocking=True)


def _stacked(scalars: list[Tensor], device: torch.device) -> Tensor:
    """0-dim tensors as one float32 vector on ``device`` (one ``stack`` where they share a dtype and a device)."""
    if len({(t.dtype, t.device) for t in scalars}) > 1:
        scalars = [t.to(device=device, dtype=torch.float32) for t in scalars]
    return torch.stack(scalars).to(device=device, dtype=torch.float32)


def module_of(entry: str) -> str:
    """The module path of a headroom entry (``"attn (ops)"`` -> ``"attn"``; a module's own entry is its path)."""
    return entry[: -len(OPS)] if entry.endswith(OPS) else entry


def _hazard(kind: str, x: Tensor, limit: float) -> Tensor:
    """An exp-like op's largest input over the log-max of its dtype (``limit``: that dtype's max), float32."""
    xf = x.detach().float()
    if kind == "exp2":
        return xf.amax() / math.log2(limit)
    if kind == "cosh":
        return xf.abs().amax() / (math.log(limit) + math.log(2.0))
    return xf.amax() / math.log(limit)


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, probe: OpProbe) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.probe.see(func, args, kwargs, out)
        return out
