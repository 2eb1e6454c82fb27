"""Replay one training batch on the current weights with hooks, leaving no trace (incident path only).

``run_pass`` is the pass; ``trace_pass`` is the same pass with the origin of its first non-finite value traced
(``forensics.origin``: every aten op checked, so it costs more, and runs only when asked).

A pass calls the ``LightningModule``'s own ``training_step`` (never a DDP wrapper, so no gradient all-reduce can
start) under the Trainer's precision context, with a forward hook on every module and a gradient hook on every module
output, then takes the gradients with ``torch.autograd.grad`` (``.grad`` is never written). Around each pass:

* every buffer is swapped for a copy (``.data``), so BatchNorm statistics and counters are never written;
* the float32 pass swaps every half-precision parameter and buffer for a float32 copy the same way: the real
  tensors' storage is never written, and the original storage is put back afterwards;
* the torch RNG state (CPU, and every CUDA device once CUDA is initialised), each module's train/eval mode and the
  autocast state are saved and restored.

What is not restored is whatever ``training_step`` does outside its tensors (appending to a list, a counter): keep
``training_step`` free of such side effects, or set ``forensics="off"``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_nanguard.forensics.isolation import preserved_state, swapped
from lightning_nanguard.forensics.manual import replaying_manual_steps
from lightning_nanguard.forensics.origin import OriginTracer
from lightning_nanguard.forensics.step_view import seen_at
from lightning_nanguard.policies.findings import PassResult
from lightning_nanguard.policies.origin import Origin
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = ["TracedPass", "preserved_state", "run_pass", "trace_pass"]

_GRAD_PARAMS_LISTED = 8


def _floats(obj: object) -> list[Tensor]:
    return [t for t in iter_tensors(obj) if t.is_floating_point()]


def _finite(t: Tensor) -> bool:
    return bool(torch.isfinite(t.detach()).all())


def _to_float32(obj: object) -> Any:
    if isinstance(obj, Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, Mapping):
        return type(obj)({k: _to_float32(v) for k, v in obj.items()}) if isinstance(obj, dict) else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_float32(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_float32(v) for v in obj)
    return obj


_Culprit = tuple[str, float | None, float | None, str]  # (module, input min, input max, output dtype)


def _finite_flag(tensors: list[Tensor]) -> Tensor:
    """One device bool: every element of every tensor is finite (no host read). ``aminmax`` propagates NaN and
    shows inf, in one pass with no tensor-sized temporary (25x cheaper than ``isfinite(t).all()`` on CPU)."""
    return _stats(tensors)[0] > 0


def _stats(tensors: list[Tensor]) -> Tensor:
    """``[all finite (1.0/0.0), largest |value|]`` of the tensors, on the device (no host read)."""
    rows = []
    for t in tensors:
        if t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t.detach())
        big = torch.maximum(lo.abs(), hi.abs()).float()
        rows.append(torch.stack([(torch.isfinite(lo) & torch.isfinite(hi)).float(), big]))
    if not rows:
        return torch.tensor([1.0, 0.0])
    if len(rows) == 1:
        return rows[0]
    both = torch.stack([r.to(rows[0].device) for r in rows])
    return torch.stack([both[:, 0].amin(), both[:, 1].amax()])


def _host_flags(flags: list[Tensor]) -> list[bool]:
    """All the flags in one host read."""
    if not flags:
        return []
    device = flags[0].device
    return [bool(v) for v in torch.stack([f.to(device) for f in flags]).tolist()]


class _Recorder:
    """Forward hooks on every module and gradient hooks on their outputs and inputs, kept as device flags and read
    once per phase (two host reads a pass, not one per module); the first non-finite wins."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.aside: Callable[[], contextlib.AbstractContextManager[object]] = (
            contextlib.nullcontext
        )  # an origin trace's ``aside``: the hooks' own ops are not traced
        self.names = {id(m): n for n, m in root.named_modules()}
        self.out_size: int | None = None
        self._root_ran = False
        # Per module call, in the order modules finish: (module, all outputs finite, its float inputs, output dtype).
        self._forward: list[tuple[str, Tensor, list[Tensor], str]] = []
        self._inputs: dict[str, tuple[list[Tensor], str]] = {}
        # Per gradient, in backward order: ("out" | "in", module, all finite).
        self._backward: list[tuple[str, str, Tensor]] = []

    def forward_hook(self, module: nn.Module, args: object, output: object) -> None:
        with self.aside():
            self._forward_hook(module, args, output)

    def _forward_hook(self, module: nn.Module, args: object, output: object) -> None:
        outs = _floats(output)
        if not outs:
            return
        # The model's output size: its own forward's output, else the last module to finish (a training_step that
        # calls the head directly). Targets are checked against it.
        if outs[0].dim() > 0 and (module is self.root or not self._root_ran):
            self.out_size = int(outs[0].shape[-1])
            self._root_ran = self._root_ran or module is self.root
        # Hooks fire as modules finish, innermost first: the first non-finite output names the deepest culprit.
        # The LightningModule itself comes last, so it is named only when its own code (not a child) went wrong.
        name = f"{type(module).__name__}.forward" if module is self.root else self.names.get(id(module), "?")
        ins = [t.detach() for t in _floats(args)]
        dtype = str(outs[0].dtype)
        self._forward.append((name, _stats(outs), ins, dtype))
        self._inputs.setdefault(name, (ins, dtype))
        if not torch.is_grad_enabled():
            return
        for t in outs:
            if t.requires_grad:
                t.register_hook(self._grad_hook("out", name))  # type: ignore[no-untyped-call]
        for t in _floats(args):
            if t.requires_grad:
                t.register_hook(self._grad_hook("in", name))  # type: ignore[no-untyped-call]

    def _grad_hook(self, kind: str, name: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            with self.aside():
                self._backward.append((kind, name, _finite_flag([grad])))

        return hook

    def resolve_forward(self) -> tuple[_Culprit | None, float, str]:
        """The first module (in the order modules finished) whose output was non-finite, and the largest finite
        |output| of any module with its name: one host read for all modules."""
        if not self._forward:
            return None, 0.0, ""
        device = self._forward[0][1].device
        table = torch.stack([st.to(device) for _, st, _, _ in self._forward]).tolist()
        first: _Culprit | None = None
        biggest, biggest_at = 0.0, ""
        for (name, _, ins, dtype), (ok, big) in zip(self._forward, table, strict=True):
            if not ok and first is None:
                first = (name, *_range(ins), dtype)
            if ok and big > biggest:
                biggest, biggest_at = big, name
        return first, biggest, biggest_at

    def first_gradient(self) -> _Culprit | None:
        """The first module (in backward order) whose backward turned finite output gradients into a non-finite input
        gradient."""
        out_ok: dict[str, bool] = {}
        for (kind, name, _), ok in zip(self._backward, _host_flags([f for _, _, f in self._backward]), strict=True):
            if kind == "out":
                out_ok[name] = out_ok.get(name, True) and ok
            elif not ok and out_ok.get(name, True):
                ins, dtype = self._inputs.get(name, ([], ""))
                return (name, *_range(ins), dtype)
        return None

    def install(self) -> list[Any]:
        return [m.register_forward_hook(self.forward_hook) for m in self.root.modules()]


def _range(tensors: list[Tensor]) -> tuple[float | None, float | None]:
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return None, None
    lo = min(float(t.float().amin()) for t in tensors)
    hi = max(float(t.float().amax()) for t in tensors)
    return lo, hi


def _loss_of(out: object) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor):
        loss = out["loss"]
        assert isinstance(loss, Tensor)
        return loss
    return None


class TracedPass(NamedTuple):
    """A replay pass with its origin: ``call`` is the origin op's name and a copy of its inputs (for a bundle's
    op-level replay; ``None`` when not kept), ``note`` why the trace stopped early, if it did."""

    result: PassResult
    origin: Origin | None
    call: tuple[str, Any, Any] | None
    note: str = ""  # why the trace stopped early ("" it did not)
    ops: int = 0  # the aten ops the trace checked


def run_pass(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    batch: object,
    batch_idx: int,
    *,
    float32: bool,
    scale: float | None = None,
    step: int | None = None,
    epoch: int | None = None,
) -> PassResult:
    """One replay of ``training_step`` with hooks: in the training precision, or in float32 (``float32=True``).
    ``step``/``epoch``: the ``global_step`` and ``current_epoch`` the step ran at (``step_view.seen_at``)."""
    return _pass(
        trainer, pl_module, batch, batch_idx, float32=float32, scale=scale, trace=None, at=(step, epoch)
    ).result


def trace_pass(
    trainer: object,
    pl_module: pl.LightningModule,
    batch: object,
    batch_idx: int,
    *,
    float32: bool = False,
    scale: float | None = None,
    max_ops: int = 200_000,
    time_budget_s: float = 60.0,
    backward_frames: bool = True,
    step: int | None = None,
    epoch: int | None = None,
) -> TracedPass:
    """``run_pass`` with the origin of its first non-finite value traced (``forensics.origin``): the op, its phase,
    the user's line and the statistics that explain it. ``origin`` is ``None`` when the pass was finite (or the
    trace found nothing: ``max_ops`` and ``time_budget_s`` bound it). ``backward_frames=False`` leaves anomaly mode
    off: cheaper, but a backward origin then names its autograd node and no line. Only ``trainer.precision_plugin``
    is used (and ``global_step``/``current_epoch`` are read as ``step``/``epoch`` where given)."""
    return _pass(
        trainer,
        pl_module,
        batch,
        batch_idx,
        float32=float32,
        scale=scale,
        trace={"max_ops": max_ops, "time_budget_s": time_budget_s, "backward_frames": backward_frames},
        at=(step, epoch),
    )


def _pass(
    trainer: Any,
    pl_module: pl.LightningModule,
    batch: Any,
    batch_idx: int,
    *,
    float32: bool,
    scale: float | None,
    trace: dict[str, Any] | None,
    at: tuple[int | None, int | None] = (None, None),
) -> TracedPass:
    recorder = _Recorder(pl_module)
    tracer: OriginTracer | None = None
    results: list[Tensor | None] = []
    loss: Tensor | None = None
    params = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
    start = time.perf_counter()
    handles: list[Any] = []
    loss_finite = grads_finite = True
    max_abs_grad = 0.0
    bad_params: list[str] = []
    error = ""
    try:
        with (
            preserved_state(pl_module),
            seen_at(pl_module, trainer, *at),
            swapped(pl_module, float32=float32),
            contextlib.ExitStack() as traced,
            contextlib.ExitStack() as stack,
        ):
            handles = recorder.install()
            stack.enter_context(torch.enable_grad())
            if float32:
                device = pl_module.device.type if pl_module.device.type in ("cpu", "cuda") else "cpu"
                stack.enter_context(torch.autocast(device_type=device, enabled=False))
                data = _to_float32(batch)
            else:
                stack.enter_context(trainer.precision_plugin.train_step_context())
                data = batch
            if trace is not None:
                tracer = traced.enter_context(OriginTracer(pl_module, data, **trace))
                recorder.aside = tracer.aside
            with replaying_manual_steps(pl_module) as manual:  # manual optimization: nothing is stepped
                loss = _loss_of(pl_module.training_step(data, batch_idx))
            if manual.losses:  # the losses given to manual_backward: their sum's gradients are theirs summed
                loss = torch.stack([x.float().sum() for x in manual.losses]).sum()
            stack.close()  # leave the precision context before the backward, as Lightning does
            if loss is None:
                error = "training_step returned no loss"
            else:
                loss_finite = _finite(loss)
                if loss.requires_grad and params:
                    stack.enter_context(torch.enable_grad())  # the caller's grad mode may be off
                    target = loss * scale if scale is not None and not float32 else loss
                    grads = torch.autograd.grad(target, [p for _, p in params], allow_unused=True)
                    results = [loss, *grads] if tracer is not None else []
                    present = [(name, g) for (name, _), g in zip(params, grads, strict=True) if g is not None]
                    if present:
                        table = torch.stack([_stats([g]).to(present[0][1].device) for _, g in present]).tolist()
                        bad_params = [name for (name, _), (ok, _) in zip(present, table, strict=True) if not ok]
                        unscale = scale if scale is not None and not float32 else 1.0
                        max_abs_grad = max((big for ok, big in table if ok), default=0.0) / unscale
                    grads_finite = not bad_params
    except Exception as exc:  # a replay must never take training down with it
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        for h in handles:
            h.remove()
    ms = (time.perf_counter() - start) * 1000.0
    origin = call = None
    if tracer is not None and not error:
        results = results or [loss]
        origin, call = tracer.resolve(results)
    first_output, max_abs, max_abs_module = recorder.resolve_forward()
    first, kind = first_output, "output"
    if first is None:
        first, kind = recorder.first_gradient(), "gradient"
    if first is None and bad_params:
        owner = bad_params[0].rsplit(".", 1)[0] if "." in bad_params[0] else bad_params[0]
        first, kind = (owner, None, None, ""), "parameter gradient"
    name, lo, hi, dtype = first if first is not None else ("", None, None, "")
    outputs_finite = first_output is None
    result = PassResult(
        reproduced=not error and not (loss_finite and outputs_finite and grads_finite),
        loss_finite=loss_finite,
        outputs_finite=outputs_finite,
        grads_finite=grads_finite,
        first_module=name,
        first_kind=kind if first is not None else "",
        input_min=lo,
        input_max=hi,
        dtype=dtype,
        grad_params=tuple(bad_params[:_GRAD_PARAMS_LISTED]),
        out_size=recorder.out_size,
        max_abs_output=max_abs,
        max_abs_grad=max_abs_grad,
        max_abs_module=max_abs_module,
        ms=ms,
        error=error,
        origin=origin,
        trace_note=tracer.truncated if tracer is not None else "",
        index_fields=tuple(sorted(tracer.index_fields)) if tracer is not None else (),
    )
    return TracedPass(result, origin, call, result.trace_note, tracer.ops_checked if tracer is not None else 0)
