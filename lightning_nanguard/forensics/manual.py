"""Replaying a manual-optimization ``training_step`` without it stepping anything (incident path only).

Under manual optimization ``training_step`` steps the optimizers itself: ``self.optimizers()``, ``manual_backward``,
``opt.step()``, ``opt.zero_grad()``, ``toggle_optimizer``, ``clip_gradients``, ``lr_schedulers()``. For the replay
(``forensics.replay``), ``replaying_manual_steps`` stands in for each of them on the module itself, for the pass
only: ``manual_backward`` records its loss (no backward: the replay takes the gradients of every recorded loss with
``torch.autograd.grad``, so ``.grad`` is never written, and no hook of the engine fires), an optimizer's ``step``
runs its closure (if given) and updates nothing, ``zero_grad``, the toggles, the clipping and a scheduler's ``step``
do nothing. So a GAN's discriminator and generator halves are both replayed, on the weights the step began with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from lightning_nanguard._lightning_compat import AttributePatches

__all__ = ["Recorded", "replaying_manual_steps"]


class Recorded:
    """The losses ``manual_backward`` was given during the pass, in order."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []


class _Optimizer:
    """An optimizer that updates nothing: ``step`` runs its closure, if any; its param groups are the real ones."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.optimizer = getattr(real, "optimizer", real)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = getattr(self.optimizer, "defaults", {})

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    @contextlib.contextmanager
    def toggle_model(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield


class _Scheduler:
    def __init__(self, real: Any) -> None:
        self._real = real

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> Any:
        return self._real.get_last_lr()


def _wrap(value: Any, make: Callable[[Any], Any]) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [make(v) for v in value]
    return make(value)


@contextlib.contextmanager
def replaying_manual_steps(pl_module: pl.LightningModule) -> Iterator[Recorded]:
    """Within the block, the module's manual-optimization calls step nothing (see the module's docstring); a module
    under automatic optimization is left as it is."""
    recorded = Recorded()
    if pl_module.automatic_optimization:
        yield recorded
        return
    optimizers = _wrap(pl_module.optimizers(), _Optimizer)
    try:
        schedulers = _wrap(pl_module.lr_schedulers(), _Scheduler)
    except Exception:  # no scheduler configured, or no trainer attached
        schedulers = None

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        recorded.losses.append(loss)

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    @contextlib.contextmanager
    def toggled(*args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    stand_ins: dict[str, Any] = {
        "manual_backward": manual_backward,
        "optimizers": lambda use_pl_optimizer=True: optimizers,
        "lr_schedulers": lambda: schedulers,
        "toggle_optimizer": nothing,
        "untoggle_optimizer": nothing,
        "clip_gradients": nothing,
        "toggled_optimizer": toggled,
    }
    patches = AttributePatches()  # instance attributes: a stand-in shadows the class's method for the pass only
    try:
        for name, fn in stand_ins.items():
            patches.set(pl_module, name, fn)
        yield recorded
    finally:
        patches.restore()
