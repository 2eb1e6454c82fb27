"""Public test doubles: deterministic fault injection, so you can test your own setup as we test ours.

Example::

    >>> from lightning.pytorch import Trainer
    >>> from lightning_nanguard import GradNormMonitor
    >>> from lightning_nanguard.testing import FaultInjector
    >>> trainer = Trainer(max_steps=10, callbacks=[FaultInjector("loss", steps=[3]), GradNormMonitor()])
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_nanguard._lightning_compat import first_element, host_buffer_marked
from lightning_nanguard._validation import check_choice, check_int
from lightning_nanguard.exceptions import NanGuardConfigError, brief
from lightning_nanguard.signals.tensors import iter_tensors

__all__ = ["FaultInjector", "HostReadCounter"]

Target = Literal["loss", "grad", "param", "input"]
_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class FaultInjector(Callback):
    """Inject NaN, inf or a spike into the loss, the gradients, a parameter or the input at chosen steps and ranks.

    Steps are optimizer steps (``trainer.global_step`` when the batch starts); with gradient accumulation every
    micro-batch of that step's window is hit. Injection is deterministic: same steps, same ranks, same element.

    * ``"loss"``: the loss is multiplied in place in ``on_before_backward`` (``"nan"`` poisons the loss and every
      gradient; a finite ``value`` such as ``1e4`` is a loss spike).
    * ``"grad"``: in ``on_after_backward`` (before unscaling and before any nanguard check), element 0 of one
      parameter's gradient becomes ``value`` (non-finite) or the gradient is multiplied by it (finite: a spike).
      Under DDP the gradients are already all-reduced here, so only the chosen ranks see the fault.
    * ``"param"``: in ``on_train_batch_start``, element 0 of one parameter becomes ``value`` (or is multiplied).
    * ``"input"``: in ``on_train_batch_start``, every floating-point tensor of the batch is multiplied by ``value``.

    Args:
        target: where to inject.
        steps: the optimizer steps to inject at (an int or a list of ints).
        value: ``"nan"``, ``"inf"``, ``"-inf"`` or a finite multiplier.
        ranks: global ranks to inject on; ``None`` for every rank.
        param_name: the parameter hit by ``"grad"``/``"param"`` (a name from ``named_parameters()``); ``None`` for
            the first parameter that has a gradient (``"grad"``) or the first parameter (``"param"``).

    Attributes:
        injected: ``(global_step, target, rank)`` for every injection made, in order.

    Raises:
        NanGuardConfigError: on an unknown target, a negative step, or an unknown value.
    """

    def __init__(
        self,
        target: Target = "loss",
        steps: int | Sequence[int] = 0,
        value: float | str = "nan",
        ranks: int | Sequence[int] | None = None,
        param_name: str | None = None,
    ) -> None:
        owner = type(self).__name__
        check_choice(owner, "target", target, ("loss", "grad", "param", "input"))
        step_list = _int_list(owner, "steps", steps)
        rank_list = None if ranks is None else _int_list(owner, "ranks", ranks)
        if param_name is not None and (not isinstance(param_name, str) or not param_name):
            raise NanGuardConfigError(
                f"{owner}(param_name={brief(param_name)}): must be a parameter name from named_parameters() or None."
            )
        if isinstance(value, str):
            if value not in _VALUES:
                raise NanGuardConfigError(f"{owner}(value={brief(value)}): must be 'nan', 'inf', '-inf' or a number.")
            number = _VALUES[value]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise NanGuardConfigError(f"{owner}(value={brief(value)}): must be 'nan', 'inf', '-inf' or a number.")
        self.target: Target = target
        self.steps = frozenset(int(s) for s in step_list)
        self.value = number
        self.ranks = None if rank_list is None else frozenset(int(r) for r in rank_list)
        self.param_name = param_name
        self.injected: list[tuple[int, str, int]] = []

    def _due(self, trainer: pl.Trainer, target: Target) -> bool:
        if self.target != target or trainer.global_step not in self.steps:
            return False
        return self.ranks is None or trainer.global_rank in self.ranks

    def _note(self, trainer: pl.Trainer) -> None:
        self.injected.append((trainer.global_step, self.target, trainer.global_rank))

    def _param(self, pl_module: pl.LightningModule, need_grad: bool) -> Tensor:
        for name, p in pl_module.named_parameters():
            if self.param_name is not None and name != self.param_name:
                continue
            if need_grad and p.grad is None:
                continue
            return p
        raise NanGuardConfigError(
            f"FaultInjector(param_name={self.param_name!r}): no such parameter"
            + (" with a gradient" if need_grad else "")
            + f"; parameters are {[n for n, _ in pl_module.named_parameters()]!r}."
        )

    def _poison(self, t: Tensor) -> None:
        from lightning_nanguard.signals.sharded import local_tensor

        # A sharded parameter (DTensor): this rank's own shard. Slicing the DTensor itself would start a collective
        # on the injecting rank alone and hang.
        t = local_tensor(t)
        with torch.no_grad():
            if math.isfinite(self.value):
                t.mul_(self.value)
            else:
                first_element(t).fill_(self.value)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if self._due(trainer, "param"):
            self._poison(self._param(pl_module, need_grad=False))
            self._note(trainer)
        elif self._due(trainer, "input"):
            with torch.no_grad():
                for t in iter_tensors(batch):
                    if t.is_floating_point():
                        t.mul_(self.value)
            self._note(trainer)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._due(trainer, "loss"):
            # In place, so the poisoned value flows into backward as it would from a real overflow.
            loss.mul_(self.value)
            self._note(trainer)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._due(trainer, "grad"):
            grad = self._param(pl_module, need_grad=True).grad
            assert grad is not None
            self._poison(grad)
            self._note(trainer)


_HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostReadCounter:
    """Count the reads of tensor values into Python (each one a device synchronization on a GPU).

    Counts every call of ``Tensor.item``, ``tolist``, ``numpy``, ``bool()``, ``float()``, ``int()`` and
    ``__index__`` made while active, by anyone: compare a guarded run with a plain one. (A dispatch mode sees
    ``item()`` as ``_local_scalar_dense`` but does not see ``tolist()``, so it under-counts.) Not counted: reads of
    nanguard's own host buffers (pinned memory a device vector was copied into without a synchronization), which
    read host memory, not the device.

    Example::

        >>> with HostReadCounter() as reads:
        ...     _ = torch.ones(2).tolist()
        >>> reads.count
        1
    """

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Callable[..., Any]] = {}
        self.paused = False

    def __enter__(self) -> HostReadCounter:
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counted(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _counted(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: Tensor, *args: object, **kwargs: object) -> object:
            if not self.paused and not host_buffer_marked(tensor):
                self.count += 1
            return original(tensor, *args, **kwargs)

        return counted


def _int_list(owner: str, name: str, value: object) -> list[Any]:
    """One int (Python or numpy) or an iterable of them, each >= 0 (a string is not an iterable of ints here)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        items: list[Any] = [value]
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise NanGuardConfigError(f"{owner}({name}={brief(value)}): must be an int >= 0 or a list of them.")
    else:
        items = list(value)
    for item in items:
        check_int(owner, name, item, minimum=0)
    return items
