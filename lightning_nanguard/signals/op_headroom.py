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
* an output that is non-finite although every tensor input was finite and no non-finite scalar was passed
  (``masked_fill(mask, -inf)`` is a value, not an overflow): ``OVERFLOWED`` (-64 bits);
* any other non-finite output (propagated from an input that was): -1, not measured.

and one entry per module, the worst of its ops (``-1`` where none ran), with the index of that op. View ops are not
measured (their values are their input's); an op outside every watched module (the loss in ``training_step``) is not
attributed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_nanguard._lightning_compat import TorchDispatchMode

__all__ = ["HAZARDS", "OPS", "OVERFLOWED", "OpProbe", "OpReading", "module_of"]

OPS = " (ops)"  # the suffix of a module's per-op entry in the headroom book: "blocks.0.attn (ops)"

OVERFLOWED = 2.0**64  # the fraction of the limit of an op that overflowed its dtype: -64 bits

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
        self.highs: list[Tensor] = []  # per op: max and -min of its output (aminmax), float32
        self.lows: list[Tensor] = []
        self.limits: list[float] = []  # per op: its output dtype's max
        self.hazard: list[Tensor | None] = []  # per op: its input's fraction of the dtype's log-max (exp-like ops)
        self.inputs: list[list[Tensor]] = []  # per op: the abs-max of each tensor input (finite or not)
        self.scalar_nonfinite: list[bool] = []  # per op: a non-finite Python scalar was passed (a fill value)


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
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # an op's output tensor -> its abs-max (device)

    @property
    def armed(self) -> bool:
        return self._mode is not None

    def arm(self) -> None:
        """Register the modules' pre/post forward hooks and enter the dispatch mode (until ``disarm``)."""
        if self._mode is not None:
            return
        self.reading, self._stack, self._made = OpReading(), [], WeakIdKeyDictionary()
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

    def _enter(self, slot: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object) -> None:
            self._stack.append(slot)

        return hook

    def _leave(self, slot: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self._stack and self._stack[-1] == slot:
                self._stack.pop()

        return hook

    def see(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """One op ran (called by the dispatch mode, with modes off): keep its output's extremes on the device."""
        if not self._stack or not isinstance(out, Tensor) or out.dtype not in self.dtypes or not out.numel():
            return
        if func.is_view:
            return
        r = self.reading
        name = str(func.overloadpacket)
        ins = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.is_floating_point()]
        if name == "aten._to_copy" and all(isinstance(t, nn.Parameter) for t in ins):
            return  # autocast's cast of a weight: a weight past the half range shows in its module's output
        lo, hi = torch.aminmax(out.detach())
        self._made[out] = torch.maximum(hi.float(), lo.float().neg())
        r.names.append(name)
        r.slots.append(self._stack[-1])
        r.highs.append(hi.float())
        r.lows.append(lo.float())
        r.limits.append(float(torch.finfo(out.dtype).max))
        r.inputs.append([self._input_amax(t).to(out.device) for t in ins])
        r.scalar_nonfinite.append(any(isinstance(a, float) and not math.isfinite(a) for a in (*args, *kwargs.values())))
        kind = HAZARDS.get(name)
        r.hazard.append(_hazard(kind, ins[0], r.limits[-1]) if kind is not None and ins else None)

    def _input_amax(self, t: Tensor) -> Tensor:
        """An input's abs-max where it is a measured op's output; else (a buffer, a batch field, a float32 op's
        output) a value that is finite exactly when the input is (one ``aminmax``, cached for the pass). A
        parameter counts as finite without a look: the suite checks the parameters at every step."""
        made = self._made.get(t)  # type: ignore[no-untyped-call]
        if made is not None:
            return made  # type: ignore[no-any-return]
        if not t.numel() or isinstance(t, nn.Parameter):
            return torch.zeros((), device=t.device)
        lo, hi = torch.aminmax(t.detach())
        amax = (hi.float() - lo.float()).abs()  # NaN or inf where the input holds a non-finite value
        self._made[t] = amax
        return amax

    def reduce(self) -> Tensor | None:
        """One float32 vector on the device, two entries per module: the largest fraction of the limit of its ops
        (-1 where none ran; the module docstring says how each is made), then the index of that op in ``last_ops``
        (-1: none). ``None`` when no half-precision op was attributed. Drops the kept values."""
        r, self.reading = self.reading, OpReading()
        if not r.names:
            return None
        device = r.highs[0].device
        out = torch.maximum(torch.stack(r.highs), torch.stack(r.lows).neg()) / torch.tensor(r.limits, device=device)
        finite_in = torch.stack(
            [
                torch.stack(ins).isfinite().all() if ins else torch.ones((), dtype=torch.bool, device=device)
                for ins in r.inputs
            ]
        )
        made_here = finite_in & ~torch.tensor(r.scalar_nonfinite, device=device)
        value = torch.where(out.isfinite(), out, torch.where(made_here, OVERFLOWED, -1.0))
        hazards = [(i, h) for i, h in enumerate(r.hazard) if h is not None]
        if hazards:
            index = torch.tensor([i for i, _ in hazards], device=device)
            value = value.scatter_reduce(0, index, torch.stack([h for _, h in hazards]), "amax")
        slots = torch.tensor(r.slots, device=device)
        n = len(self.names)
        per_module = torch.full((n,), -1.0, device=device).scatter_reduce(0, slots, value, "amax")
        index = torch.arange(len(r.names), device=device, dtype=torch.float32)
        candidate = torch.where(value == per_module[slots], index, -1.0)  # no boolean indexing: no device sync
        worst = torch.full((n,), -1.0, device=device).scatter_reduce(0, slots, candidate, "amax")
        self.last_ops = list(r.names)
        return torch.cat([per_module, worst])


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
