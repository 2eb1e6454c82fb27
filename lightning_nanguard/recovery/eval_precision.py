"""Running an evaluation step in float32 without touching the real parameters (no Trainer needed).

``Fp32Eval`` patches one evaluation (validation or test) of a LightningModule between ``on_{validation,test}_start``
and ``*_end``, through ``_lightning_compat.AttributePatches`` (what was there before is put back, so a
``torch.compile``-d step stays compiled):

* under ``*-mixed`` the precision plugin's ``val_step_context``/``test_step_context`` disables autocast;
* under ``*-true`` the step runs on ``Fp32Weights`` (built lazily, once per evaluation) under a float32 default
  dtype, and the plugin's ``convert_input`` leaves the batch in float32 (the half-precision attempt of
  ``"on_nonfinite"`` casts it itself);
* under ``mode="on_nonfinite"`` the step is wrapped: its ``self.log`` calls are deferred (``DeferredLog``) until its
  outputs are known finite; a non-finite batch is re-run in float32, what the bad call logged is dropped and the
  re-run's values are logged instead. The module's ``torchmetrics`` states are saved before each half-precision call
  (only where the module has metrics) and put back before a re-run, so a metric counts a re-run batch once.

The pieces it assembles:

* ``Fp32Weights``: temporary float32 copies of a half-precision module's floating parameters and buffers, and a call
  of any of its methods on them through the public ``torch.func.functional_call``. The real parameters keep their
  dtype and their autograd nodes, which is what keeps DDP's gradient all-reduce hooks alive (casting them with
  ``module.float()``/``.half()`` silently disconnects them);
* ``DeferredLog``: holds back what a step logged with ``self.log`` until its outputs are known to be finite, so that
  a re-run's values replace, rather than add to, the half-precision ones in Lightning's epoch accumulation;
* ``nonfinite_flag``: one device flag for "anything non-finite in these outputs", read once per batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_nanguard._lightning_compat import (
    EVAL_STEP_CONTEXT,
    AttributePatches,
    MetricStates,
    takes_dataloader_iter,
)
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = [
    "DeferredLog",
    "Fp32Eval",
    "Fp32Weights",
    "Rerun",
    "RerunGroup",
    "autocast_device",
    "autocast_disabled",
    "batch_list",
    "default_dtype",
    "floating_tensors",
    "group_reruns",
    "nonfinite_flag",
    "rerun_message",
    "rerun_where",
]

# One batch this rank re-ran in float32: (stage, batch_idx, finite in float32).
Rerun = tuple[str, int, bool]
_STAGE = {"validation_step": "validation", "test_step": "test"}


@contextmanager
def autocast_disabled(device_type: str) -> Iterator[None]:
    """Autocast off for ``device_type`` (the step computes in its inputs' and weights' dtype: float32 under AMP)."""
    with torch.autocast(device_type, enabled=False):
        yield


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created without an explicit dtype inside the block get ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _MethodCaller(nn.Module):
    """A module whose forward calls one method of ``owner``, so that ``functional_call`` can reparametrize it."""

    def __init__(self, owner: nn.Module, method: Callable[..., Any]) -> None:
        super().__init__()
        self.owner = owner
        self._method = method

    def forward(self, *args: object, **kwargs: object) -> Any:
        return self._method(*args, **kwargs)


class Fp32Weights:
    """Float32 copies of ``module``'s floating parameters and buffers, built on first use and then reused.

    Build and use them only while the module's weights do not change (one evaluation epoch); ``release`` frees them.
    Costs one float32 copy of the half-precision weights in memory while held.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._state: dict[str, Tensor] | None = None
        self.builds = 0

    @property
    def built(self) -> bool:
        return self._state is not None

    def state(self) -> dict[str, Tensor]:
        if self._state is None:
            state: dict[str, Tensor] = {}
            with torch.no_grad():
                for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
                    if t.is_floating_point():
                        state["owner." + name] = t.detach().to(torch.float32)
            self._state = state
            self.builds += 1
        return self._state

    def call(self, method: Callable[..., Any], *args: object, **kwargs: object) -> Any:
        """``method(*args, **kwargs)`` with the module's floating weights swapped for their float32 copies."""
        caller = _MethodCaller(self.module, method)
        return torch.func.functional_call(caller, self.state(), args, kwargs, tie_weights=True, strict=False)

    def release(self) -> None:
        self._state = None


class DeferredLog:
    """Stands in for ``LightningModule.log`` while a step's outcome is undecided.

    ``deferring`` on: calls are recorded, not passed on (``replay`` passes them on in order, ``discard`` drops them).
    ``deferring`` off: calls go straight to ``log_fn``. Lightning's ``log_dict`` calls ``self.log`` and is covered.
    """

    def __init__(self, log_fn: Callable[..., Any]) -> None:
        self.log_fn = log_fn
        self.deferring = False
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: object, **kwargs: object) -> None:
        if self.deferring:
            self.calls.append((args, kwargs))
        else:
            self.log_fn(*args, **kwargs)

    def begin(self) -> None:
        self.calls.clear()
        self.deferring = True

    def values(self) -> list[Any]:
        """The logged values (second positional argument or ``value=``) of the recorded calls."""
        out = []
        for args, kwargs in self.calls:
            if len(args) >= 2:
                out.append(args[1])
            elif "value" in kwargs:
                out.append(kwargs["value"])
        return out

    def replay(self) -> None:
        self.deferring = False
        calls, self.calls = self.calls, []
        for args, kwargs in calls:
            self.log_fn(*args, **kwargs)

    def discard(self) -> None:
        self.deferring = False
        self.calls = []


def floating_tensors(obj: object) -> Iterator[Tensor]:
    """Every floating-point (or complex) tensor in a step output, nested (``signals.tensors.iter_tensors``)."""
    return (t for t in iter_tensors(obj) if t.is_floating_point() or t.is_complex())


def nonfinite_flag(*collections: object) -> Tensor | bool:
    """True where anything in ``collections`` is NaN/inf: a 0-d device bool tensor (no host read), or a Python bool.

    Python numbers are checked on the host; tensors on the device, reduced to a single flag.
    """
    flags: list[Tensor] = []
    for collection in collections:
        for item in collection if isinstance(collection, list) else [collection]:
            if isinstance(item, (float, int)) and not isinstance(item, bool):
                if not math.isfinite(item):
                    return True
                continue
            flags.extend(torch.isfinite(t).all() for t in floating_tensors(item))
    if not flags:
        return False
    device = flags[0].device
    return ~torch.stack([f.to(device) for f in flags]).all()


def autocast_device(plugin: object) -> str:
    """The device type a precision plugin autocasts on (``"cpu"`` for a plugin without one)."""
    return str(getattr(plugin, "device", "cpu"))


class Fp32Eval:
    """One evaluation's patches: every step in float32 (``mode="always"``), or only the non-finite ones re-run in
    float32 (``"on_nonfinite"``; this rank's re-runs collect in ``pending``).

    Args:
        mode: ``"always"`` or ``"on_nonfinite"``.
        kind: ``Precision.kind``: autocast to switch off (``"mixed"``), half weights to copy to float32 (``"true"``),
            or nothing to do (``"none"``).
    """

    def __init__(self, mode: str, kind: Literal["mixed", "true", "none"] = "none") -> None:
        self.mode = mode
        self.kind = kind
        self.pending: list[Rerun] = []
        self._patches = AttributePatches()
        self._weights: Fp32Weights | None = None
        self._metrics: MetricStates | None = None

    def begin(self, plugin: Any, pl_module: Any, step_name: str, warn: Callable[[str], None]) -> None:
        """Patch ``pl_module``'s ``step_name`` (``"validation_step"`` or ``"test_step"``) and ``plugin``; a step that
        cannot be handled runs unchanged, and ``warn`` is told why."""
        self.end()  # a previous evaluation that ended abnormally
        self.pending = []
        if self.kind == "none":
            return
        step = getattr(pl_module, step_name)
        if self.mode == "on_nonfinite" and takes_dataloader_iter(step):
            warn(
                f"FP32Evaluation(mode='on_nonfinite') cannot re-run a `{step_name}(dataloader_iter)`: the batch is "
                "consumed by the step. Evaluation runs unchanged; use mode='always' instead."
            )
            return
        convert = plugin.convert_input  # the half-precision cast, for the first attempt under "on_nonfinite"
        if self.kind == "true":
            self._weights = Fp32Weights(pl_module)
            # The batch stays float32; the half-precision attempt ("on_nonfinite") casts it itself.
            self._patches.set(plugin, "convert_input", _identity)
        context = EVAL_STEP_CONTEXT[step_name]
        if self.mode == "always":
            if self.kind == "mixed":
                device = autocast_device(plugin)
                self._patches.set(plugin, context, lambda: autocast_disabled(device))
                return  # the step itself is untouched: weights and inputs are already float32
            self._patches.set(plugin, context, lambda: default_dtype(torch.float32))
        deferred = DeferredLog(pl_module.log) if self.mode == "on_nonfinite" else None
        if deferred is not None:
            self._patches.set(pl_module, "log", deferred)
            self._metrics = MetricStates(pl_module) or None
        self._patches.set(pl_module, step_name, self._wrap(plugin, step, _STAGE[step_name], deferred, convert))

    def end(self) -> None:
        """Put back every patch and free the float32 copies."""
        self._patches.restore()
        self._metrics = None
        if self._weights is not None:
            self._weights.release()
            self._weights = None

    def _wrap(self, plugin: Any, step: Any, stage: str, deferred: DeferredLog | None, convert: Any) -> Any:
        @functools.wraps(step)
        def fp32_step(*args: Any, **kwargs: Any) -> Any:
            if deferred is None:  # mode="always", true half precision
                return self._fp32_call(plugin, step, args, kwargs)
            first_args = (convert(args[0]), *args[1:]) if self.kind == "true" and args else args
            metrics = self._metrics
            saved = metrics.save() if metrics is not None else None
            deferred.begin()
            try:
                output = step(*first_args, **kwargs)
            except BaseException:
                deferred.discard()
                raise
            # This rank decides alone (one host read, no collective): ranks may see different numbers of batches,
            # and a per-batch collective would then wait forever. The logged values are deferred, so each rank
            # still logs once per batch; the re-runs are gathered and recorded at the epoch end.
            if not bool(nonfinite_flag(output, deferred.values())):
                deferred.replay()
                return output
            deferred.discard()  # the bad call's logged values must not reach Lightning's epoch accumulation
            if saved is not None:
                MetricStates.restore(saved)  # nor its metric updates: the re-run updates them once
            output = self._fp32_call(plugin, step, args, kwargs)
            batch_idx = int(args[1]) if len(args) > 1 and isinstance(args[1], int) else int(kwargs.get("batch_idx", -1))
            self.pending.append((stage, batch_idx, not bool(nonfinite_flag(output))))
            return output

        return fp32_step

    def _fp32_call(self, plugin: Any, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.kind == "mixed":
            with autocast_disabled(autocast_device(plugin)):
                return step(*args, **kwargs)
        assert self._weights is not None
        with default_dtype(torch.float32):
            return self._weights.call(step, *args, **kwargs)


def _identity(data: object) -> Any:
    return data


@dataclass(frozen=True)
class RerunGroup:
    """The batches of one evaluation epoch re-run in float32 with one outcome: one incident."""

    stage: str  # "validation" | "test"
    fp32_finite: bool  # finite in float32 on every rank that re-ran them
    batches: tuple[int, ...]  # batch indices, in order
    ranks: tuple[int, ...]  # the ranks that re-ran any of them


def group_reruns(gathered: Sequence[Sequence[Rerun]]) -> list[RerunGroup]:
    """Every rank's re-runs (``gathered[rank]``) as groups: by stage, then batches finite in float32 before the
    ones that were not (a batch counts as finite only where every rank that re-ran it found it finite)."""
    merged: dict[tuple[str, int], tuple[list[int], bool]] = {}
    for rank, part in enumerate(gathered):
        for stage, batch_idx, fp32_finite in part:
            ranks, finite = merged.get((stage, batch_idx), ([], True))
            merged[(stage, batch_idx)] = ([*ranks, rank], finite and fp32_finite)
    groups: dict[tuple[str, bool], tuple[list[int], set[int]]] = {}
    for (stage, batch_idx), (ranks, finite) in sorted(merged.items()):
        batches, seen = groups.setdefault((stage, not finite), ([], set()))
        batches.append(batch_idx)
        seen.update(ranks)
    return [
        RerunGroup(stage, not failed, tuple(batches), tuple(sorted(seen)))
        for (stage, failed), (batches, seen) in sorted(groups.items())
    ]


def batch_list(batches: Sequence[int], limit: int = 8) -> str:
    """``"0, 1, 2"``; past ``limit`` the first ones and ``"and N more"``."""
    shown = ", ".join(str(b) for b in batches[:limit])
    return shown + (f" and {len(batches) - limit} more" if len(batches) > limit else "")


def rerun_where(group: RerunGroup) -> str:
    """Where the incident happened: ``"validation batch 3"``, ``"4 validation batches: 0, 1, 2, 3"``."""
    if len(group.batches) == 1:
        return f"{group.stage} batch {group.batches[0]}"
    return f"{len(group.batches)} {group.stage} batches: {batch_list(group.batches)}"


def rerun_message(group: RerunGroup, half: str) -> str:
    """The incident's sentence for one epoch's re-run batches (``half``: ``"float16"``/``"bfloat16"``)."""
    n, stage, listed = len(group.batches), group.stage, batch_list(group.batches)
    them = f"{n} {stage} batch{'es' if n > 1 else ''} ({listed})"
    if not group.fp32_finite:
        data = "these batches' data" if n > 1 else "this batch's data"
        return (
            f"{them} {'are' if n > 1 else 'is'} non-finite in {half} and in float32 too: not a precision overflow. "
            f"Check {data} and the model's weights."
        )
    return (
        f"{them} overflowed in {half} and {'were' if n > 1 else 'was'} re-run in float32, where "
        f"{'they are' if n > 1 else 'it is'} finite: the float32 results replace the {half} ones. If this happens "
        "every epoch, mode='always' saves the double work."
    )
