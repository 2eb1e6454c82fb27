"""Find the op that made a replay pass's first non-finite value, and the line of the user's code that called it.

``OriginTracer`` wraps one replay pass (``forensics.replay.trace_pass``: the incident path, never a healthy step).
A ``TorchDispatchMode`` sees every aten op the pass runs, forward and backward, after autocast (so with the dtypes
that really ran). Each op's floating outputs are checked (``aminmax``, one host read per op; a view of finite
tensors is not); an op whose inputs were all finite and whose output is not is an *event*, recorded with its
statistics (``op_stats``) and the user's frame: from the Python stack for a forward op, and for a backward op from
the forward stack autograd kept for the node that runs it (anomaly mode's ``traceback_``, turned on for the pass).

Infinities are often intended, so every non-finite tensor carries the event its values came from:

* *intended*: an op with a non-finite scalar argument (``masked_fill(mask, -inf)``, ``full(-inf)``), a constant, or
  a batch field whose only non-finite values are -inf (an additive attention mask). Never an origin;
* *birth*: finite inputs, non-finite output by arithmetic (``exp``, ``log(0)``, ``x / 0``, an ``mm`` overflow),
  or a NaN made from infinities (``inf - inf``, a softmax row of all -inf): its parent is the event those
  infinities came from;
* *input* / *state*: a batch field holding NaN or +inf, a parameter or buffer holding NaN or +inf (a buffer of
  finite values and -inf, a registered causal mask, is intended).

At the end, the step's non-finite results (the loss, the gradients) name their events; the origin is the earliest
root among them: a chain of births is followed back through arithmetic infinities and stops at intended ones (so a
fully masked softmax row is the softmax, while ``log(0)`` feeding ``0 * -inf`` is the ``log``). An op whose finite
output discarded non-finite inputs (``torch.where``) is kept on the event as ``masked_by``: a masked branch whose
gradient later surfaces is told apart. A healthy pass reports no origin, whatever infinities it handled.

The cost is bounded: ``max_ops`` ops checked and ``time_budget_s`` seconds, then the mode only passes ops through
(``truncated`` says why).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_nanguard._lightning_compat import (
    TorchDispatchMode,
    autograd_node,
    node_stack,
    op_is_mutable,
    tensor_version,
)
from lightning_nanguard.forensics.op_stats import (
    frame_from_stack,
    frame_from_traceback,
    module_from_stack,
    op_stats,
    rows_of,
)
from lightning_nanguard.forensics.origin_events import (
    FINITE,
    VALUE_FREE,
    Event,
    Status,
    batch_fields,
    chain_of,
    check,
    copy_args,
    float_tensors,
    nonfinite_scalar,
    to_origin,
)
from lightning_nanguard.policies.origin import Origin, SourceFrame, Stat
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = ["OriginTracer"]

EVENTS_EXPLAINED = 256  # births past this many are kept without statistics or frame
# Ops that look a parameter's rows up by an integer tensor: a batch field used so conditions the model.
_INDEXING = ("aten.embedding.", "aten.embedding_bag.", "aten._embedding_bag.", "aten.index_select.")
# Ops that multiply their input by a weight: a batch field of -inf reaching one is a feature, not a mask.
_WEIGHTED: tuple[str, ...] = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.", "aten.mv.")
_WEIGHTED += ("aten.linear.", "aten.addmv.", "aten.convolution.", "aten._convolution.")


class OriginTracer:
    """Trace one pass (``with tracer:`` around its forward and backward), then ``tracer.origin(results)``.

    Args:
        root: the module the pass runs (names the module of a forward op, and the parameters and buffers).
        batch: the step's batch as ``training_step`` receives it (names the fields and rows of a bad input).
        max_ops: ops checked at most, then the trace stops.
        time_budget_s: seconds of tracing at most, then the trace stops.
        keep_call_bytes: the origin op's inputs are kept (for an op-level offline replay) up to this size.
        backward_frames: turn anomaly mode on for the pass, so a backward op names its forward line.
    """

    def __init__(
        self,
        root: nn.Module | None = None,
        batch: object = None,
        *,
        max_ops: int = 200_000,
        time_budget_s: float = 60.0,
        keep_call_bytes: int = 16 << 20,
        backward_frames: bool = True,
    ) -> None:
        self.max_ops, self.time_budget_s = max_ops, time_budget_s
        self.backward_frames = backward_frames
        self.ops_checked = 0
        self.truncated = ""
        self._keep_left = keep_call_bytes
        self._names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        self._state = {}
        if root is not None:
            self._state = {id(t): n for n, t in (*root.named_parameters(), *root.named_buffers())}
        self._batch = {id(t): name for name, t in batch_fields(batch)}
        sizes = [t.shape[0] for _, t in batch_fields(batch) if t.dim() > 0]
        self._batch_size: int | None = sizes[0] if sizes else None
        self._seen: dict[int, tuple[weakref.ref[Tensor], int, Status]] = {}
        self._made: dict[int, tuple[weakref.ref[Tensor], str, list[weakref.ref[Tensor]]]] = {}
        self._events: list[Event] = []
        self._births = 0
        self._start = 0.0
        self._stopped = False
        self._aside = 0  # > 0 while the replay's own bookkeeping runs (``aside``): its ops are not the pass's
        self._mode: Any = None
        self._anomaly: Any = None
        self.index_fields: set[str] = set()  # integer batch fields that index a parameter (embedding rows)

    # ---------------------------------------------------------------------------------------------- the context
    def __enter__(self) -> OriginTracer:
        self._start = time.perf_counter()
        if self.backward_frames:
            self._anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped = True
        self._mode.__exit__(None, None, None)
        if self._anomaly is not None:
            self._anomaly.__exit__(None, None, None)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Ops run in this block (the replay's own hooks) pass through unchecked: they are not the model's."""
        self._aside += 1
        try:
            yield
        finally:
            self._aside -= 1

    def _stop(self, why: str) -> None:
        self._stopped = True
        self.truncated = self.truncated or why

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._stopped or self._aside:
            return func(*args, **kwargs)
        self.ops_checked += 1
        if self.ops_checked > self.max_ops:
            self._stop(f"stopped after max_ops={self.max_ops} ops")
            return func(*args, **kwargs)
        if self.ops_checked % 64 == 0 and time.perf_counter() - self._start > self.time_budget_s:
            self._stop(f"stopped after time_budget_s={self.time_budget_s:g} s, {self.ops_checked} ops")
            return func(*args, **kwargs)
        if str(func).startswith(_INDEXING):
            self._indexed(args)
        try:
            ins = float_tensors((args, kwargs))
            before = [self._status(t) for t in ins]
        except Exception as exc:  # the trace must never take the replay down with it
            self._stop(f"the tracer failed before {func}: {type(exc).__name__}: {exc}"[:200])
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            self._after(func, args, kwargs, ins, before, out)
        except Exception as exc:
            self._stop(f"the tracer failed after {func}: {type(exc).__name__}: {exc}"[:200])
        return out

    def _indexed(self, args: tuple[Any, ...]) -> None:
        """An integer batch field that indexes a parameter's rows conditions the model: no class target."""
        weight = args[0] if args else None
        if not (isinstance(weight, Tensor) and id(weight) in self._state):
            return
        for a in args[1:]:
            if isinstance(a, Tensor) and not a.is_floating_point() and id(a) in self._batch:
                self.index_fields.add(self._batch[id(a)])

    # ------------------------------------------------------------------------------------------------ the trace
    def _remember(self, t: Tensor, status: Status) -> None:
        self._seen[id(t)] = (weakref.ref(t), tensor_version(t), status)

    def _status(self, t: Tensor) -> Status:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == tensor_version(t):
            return hit[2]
        [(finite, nan)] = check([t])
        status = FINITE if finite else Status(False, nan, self._source(t, nan))
        self._remember(t, status)
        return status

    def _source(self, t: Tensor, nan: bool) -> int:
        """The event for a non-finite tensor no traced op made: a batch field, a parameter or buffer, a constant."""
        if id(t) in self._batch:
            bad = ~torch.isfinite(t.detach())
            neg_inf_only = not nan and bool((t.detach()[bad] == -math.inf).all())
            kind = "intended" if neg_inf_only else "input"
            produced = "-inf" if neg_inf_only else "nan" if nan else "inf"
            stats: dict[str, Stat] = {"nonfinite_elements": int(bad.sum())}
            rows = rows_of(bad, self._batch_size)
            return self._add(Event(0, kind, produced=produced, fields=(self._batch[id(t)],), stats=stats, rows=rows))
        if id(t) in self._state:
            # A buffer of finite values and -inf (a causal or padding mask) is intended, like such a batch field.
            name = self._state[id(t)]
            if not nan and bool((t.detach()[~torch.isfinite(t.detach())] == -math.inf).all()):
                return self._add(Event(0, "intended", produced="-inf", fields=(name,)))
            return self._add(Event(0, "state", produced="nan" if nan else "inf", fields=(name,)))
        return self._add(Event(0, "intended", produced="nan" if nan else "inf", fields=("a constant",)))

    def _add(self, ev: Event) -> int:
        ev.index = len(self._events)
        self._events.append(ev)
        return ev.index

    def _producer(self, t: Tensor) -> tuple[str, list[Any]] | None:
        hit = self._made.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1], [r() for r in hit[2] if r() is not None]

    def _made_by(self, func: Any, args: Any, out: Tensor) -> None:
        name = str(func)
        operands = (
            [weakref.ref(a) for a in args if isinstance(a, Tensor)]
            if name.startswith(("aten.rsub", "aten.sub"))
            else []
        )
        self._made[id(out)] = (weakref.ref(out), name, operands)

    def _after(self, func: Any, args: Any, kwargs: Any, ins: list[Tensor], before: list[Status], out: Any) -> None:
        outs = float_tensors(out)
        if not outs:
            return
        bad = [s for s in before if not s.finite]
        if bad and str(func).startswith(_WEIGHTED):
            self._features(bad)
        if func.is_view and ins:  # a view keeps its base's producer
            made = self._made.get(id(ins[0]))
            if made is not None and made[0]() is ins[0]:
                self._made[id(outs[0])] = (weakref.ref(outs[0]), made[1], made[2])
        if not bad and func.is_view:  # a view of finite tensors is finite
            for t in outs:
                self._remember(t, FINITE)
            return
        checks = check(outs)
        if not func.is_view:
            self._made_by(func, args, outs[0])
        if all(finite for finite, _ in checks):
            for t in outs:
                self._remember(t, FINITE)
            if bad and not func.is_view and not str(func).startswith(VALUE_FREE):
                self._absorbed(func, bad)
            return
        out_nan = any(nan for _, nan in checks)
        if bad and not (out_nan and not any(s.nan for s in bad)):
            tag = self._pick(bad, nan=out_nan)  # the non-finite values passed through
            if not func.is_view:  # a view is no use: the first op that reads the values is
                self._first_use(tag, func)
        else:
            parent = self._pick(bad, nan=False) if bad else None
            intended = not bad and nonfinite_scalar((args, kwargs))
            tag = self._birth(
                func, args, kwargs, ins, outs, checks, "intended" if intended else "birth", parent, out_nan
            )
        for t, (finite, nan) in zip(outs, checks, strict=True):
            self._remember(t, FINITE if finite else Status(False, nan, tag))

    def _features(self, bad: list[Status]) -> None:
        """A batch field of -inf taken for a mask that goes through a weight is a feature: its rows are bad data."""
        for s in bad:
            ev = self._events[s.tag] if s.tag is not None else None
            if ev is not None and ev.kind == "intended" and ev.rows and ev.fields and ev.fields[0] != "a constant":
                ev.kind = "input"

    def _pick(self, bad: list[Status], *, nan: bool) -> int | None:
        """The event a non-finite output inherits: one carrying NaN when the output has NaN, a real one first."""
        pool = [s for s in bad if s.nan] if nan else bad
        pool = pool or bad
        real = [s for s in pool if s.tag is not None and self._events[s.tag].kind != "intended"]
        return (real or pool)[0].tag

    def _first_use(self, tag: int | None, func: object) -> None:
        if tag is None:
            return
        ev = self._events[tag]
        if ev.kind in ("input", "state", "intended") and not ev.op:
            ev.op = str(func)
            ev.frame = frame_from_stack()
            ev.module = module_from_stack(self._names) or ""

    def _absorbed(self, func: object, bad: list[Status]) -> None:
        """A finite output from non-finite inputs: the op masked them away (kept on every real ancestor event)."""
        frame: SourceFrame | None = None
        for s in bad:
            tag = s.tag
            while tag is not None:
                ev = self._events[tag]
                if ev.kind == "birth" and not ev.masked_by:
                    frame = frame or frame_from_stack()
                    ev.masked_by, ev.masked_frame = str(func), frame
                tag = ev.parent

    def _birth(
        self,
        func: Any,
        args: Any,
        kwargs: Any,
        ins: list[Tensor],
        outs: list[Tensor],
        checks: list[tuple[bool, bool]],
        kind: str,
        parent: int | None,
        out_nan: bool,
    ) -> int:
        node = autograd_node()
        ev = Event(0, kind, op=str(func), phase="backward" if node is not None else "forward", parent=parent)
        ev.produced = "nan" if out_nan else "inf"
        ev.node = type(node).__name__ if node is not None else ""
        ev.input_dtypes = tuple(str(t.dtype) for t in ins)
        ev.output_dtype = str(outs[0].dtype)
        if kind == "birth" and self._births < EVENTS_EXPLAINED:
            self._births += 1
            bad_out = next(t for t, (finite, _) in zip(outs, checks, strict=True) if not finite)
            ev.frame = frame_from_traceback(node_stack(node)) if node is not None else frame_from_stack()
            ev.module = "" if node is not None else module_from_stack(self._names) or ""
            ev.stats, ev.rows = op_stats(ev.op, tuple(args), bad_out, self._producer, self._batch_size)
            ev.call = self._keep_call(func, args, kwargs)
        elif kind == "intended":
            ev.frame = frame_from_stack() if node is None else None
        return self._add(ev)

    def _keep_call(self, func: Any, args: Any, kwargs: Any) -> tuple[str, Any, Any] | None:
        """The op's inputs, copied, for an op-level offline replay (not an in-place op's: its input is overwritten)."""
        if op_is_mutable(func):
            return None
        tensors = list(iter_tensors((args, kwargs)))
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > self._keep_left or any(type(t) not in (Tensor, nn.Parameter) for t in tensors):
            return None
        self._keep_left -= size
        return str(func), copy_args(tuple(args)), copy_args(dict(kwargs))

    # ------------------------------------------------------------------------------------------------ the verdict
    def _root_chain(self, results: Sequence[Tensor | None]) -> list[Event] | None:
        self._stopped = True  # this method's own ops are not part of the pass
        tensors = [t for t in results if isinstance(t, Tensor) and t.is_floating_point()]
        bad = [t for t, (finite, _) in zip(tensors, check(tensors), strict=True) if not finite]
        if not bad:
            return None
        tags = []
        for t in bad:
            hit = self._seen.get(id(t))
            if hit is not None and hit[0]() is t and hit[2].tag is not None:
                tags.append(hit[2].tag)
        if not tags:  # results made outside the trace: fall back on the first real event
            tags = [e.index for e in self._events if e.kind != "intended"][:1]
        chains = [chain_of(self._events, tag) for tag in tags]
        return min(chains, key=lambda c: c[-1].index) if chains else None

    def origin(self, results: Sequence[Tensor | None]) -> Origin | None:
        """The origin of the non-finite values among ``results`` (the loss, the gradients); ``None`` when they are
        all finite or no event explains them. Call after the ``with`` block."""
        return self.resolve(results)[0]

    def resolve(self, results: Sequence[Tensor | None]) -> tuple[Origin | None, tuple[str, Any, Any] | None]:
        """The origin, and the origin op's name with a copy of its inputs (``None`` when not kept: too large, or
        an in-place op)."""
        chain = self._root_chain(results)
        if chain is None:
            return None, None
        origin = to_origin(
            chain, self._events, ops_checked=self.ops_checked, truncated=self.truncated, batch_size=self._batch_size
        )
        return origin, chain[-1].call


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, tracer: OriginTracer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.tracer.dispatch(func, tuple(args), dict(kwargs or {}))
