"""Where the side-stream snapshot copy is waited for: after the forward and backward, before the optimizer's update
(checked on the CPU with a stand-in for the CUDA event; tests/gpu runs the real copy)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard.recovery.side_copy import SideCopy
from tests.helpers import TinyModel, make_trainer


class Event:
    """A copy that is still running until ``done``."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _gate(order: list[str]) -> SideCopy:
    gate = object.__new__(SideCopy)  # no CUDA stream: only the hook is under test
    gate.device, gate.pending, gate._handles = torch.device("cpu"), Event(), []
    gate._wait = lambda event: order.append("wait")  # type: ignore[method-assign]
    return gate


@pytest.mark.parametrize("closure", [False, True])
def test_the_update_waits_for_the_copy_after_the_closure(closure: bool) -> None:
    order: list[str] = []
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    opt.register_step_post_hook(lambda *args: order.append("update"))
    gate = _gate(order)
    gate.watch([opt])

    def forward_backward() -> torch.Tensor:
        order.append("forward+backward")
        loss = p.square().sum()
        loss.backward()
        return loss

    if closure:
        opt.step(forward_backward)
    else:
        forward_backward()
        opt.step()
    assert order == ["forward+backward", "wait", "update"]
    gate.pending.done = True  # type: ignore[union-attr]
    order.clear()
    forward_backward()
    opt.step()
    assert order == ["forward+backward", "update"]  # the copy is complete: no wait, and none from now on
    assert gate.pending is None
    gate.unwatch()


class Order(pl.Callback):
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def on_after_backward(self, *args: Any) -> None:
        self.order.append("backward")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:  # a snapshot's copy starts before this batch
            self.gate.pending = Event()
        trainer.optimizers[0].register_step_post_hook(lambda *a: self.order.append("update"))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.gate = _gate(self.order)
        self.gate.pending = None
        self.gate.watch(trainer.optimizers)


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_lightnings_optimizer_step_waits_after_the_backward(tmp_path: Any, precision: str) -> None:
    order: list[str] = []
    make_trainer(tmp_path, precision, callbacks=[Order(order)], max_steps=2).fit(TinyModel())
    assert "wait" in order
    at = order.index("wait")
    assert order[at - 1] == "backward"
    assert order[at + 1] == "update"
