"""Tensors of any strides: snapshots, rollbacks, skips and checkpoints (issue 30).

A one-element parameter with stride 0 (Pyro's AutoNormal guide makes one; Adam's state inherits the stride) crashed
AutoRollback's first snapshot before step 1 (``byte_view``: torch calls such a tensor contiguous, ``reshape(-1)``
keeps the stride 0, and a ``uint8`` view of it is refused). Every path that views a tensor's memory is run here over
the strides a model can hold: stride 0 on a one-element dimension, a 0-d tensor, a transposed (dense, not
contiguous) weight, an expanded buffer and one with gaps (neither dense: typed copies), an empty tensor.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_nanguard import default_callbacks, verify_checkpoint
from lightning_nanguard.checkpointing.verify import nonfinite_tensors
from lightning_nanguard.engine import get_engine
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.recovery.snapshot_layout import byte_view
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, make_trainer

TENSORS = {
    "one_element_stride0": lambda: torch.full((), 2.0).expand(1),
    "one_by_one_stride0": lambda: torch.full((), 3.0).expand(1, 1),
    "zero_dim": lambda: torch.tensor(4.0),
    "transposed": lambda: torch.randn(3, 4).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "empty": lambda: torch.empty(0, 3),
    "expanded": lambda: torch.ones(()).expand(3),  # overlapping: no byte view
    "every_other_column": lambda: torch.randn(4, 6)[:, ::2],  # gaps: no byte view
}
NOT_DENSE = {"expanded", "every_other_column"}


@pytest.mark.parametrize("name", list(TENSORS))
def test_a_byte_view_round_trips_every_dense_tensor_in_place(name: str) -> None:
    t = TENSORS[name]()
    view = byte_view(t)
    if name in NOT_DENSE:
        assert view is None
        return
    assert view is not None
    assert view.dtype == torch.uint8
    assert view.numel() == t.numel() * t.element_size()
    saved, before = view.clone(), t.clone()
    if t.numel():
        view.zero_()  # writes through to the tensor's own memory
        assert not torch.equal(t, before) or not before.any()
    view.copy_(saved)
    assert torch.equal(t, before)


class Strided(TinyModel):
    """TinyModel with parameters and buffers of every kind of stride (``TENSORS``), all used by the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Parameter(torch.zeros(()).expand(1))  # shape (1,), stride (0,): Pyro's one-element site
        self.one11 = nn.Parameter(torch.zeros(()).expand(1, 1))
        self.scalar = nn.Parameter(torch.tensor(0.0))
        self.mix = nn.Parameter(torch.eye(4, 16).t().contiguous().t())  # (4, 16) viewed with stride (1, 4)
        # Not saved: torch's own load_state_dict cannot copy into memory its elements share (plain Lightning neither).
        self.register_buffer("expanded", torch.ones(()).expand(3), persistent=False)
        self.register_buffer("every_other", torch.randn(4, 6)[:, ::2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) @ self.mix.t() @ self.mix
        extra = self.expanded.sum() * 0 + self.every_other.sum() * 0
        return self.head(h) + self.one + self.one11.squeeze(0) + self.scalar + extra


def test_the_strides_are_what_the_model_means() -> None:
    model = Strided()
    assert model.one.stride() == (0,)
    assert model.one11.stride() == (0, 0)
    assert not model.mix.is_contiguous()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 8)).sum().backward()
    opt.step()
    assert opt.state[model.one]["exp_avg"].stride() == (0,)  # Adam's state inherits the stride


def test_a_snapshot_restores_every_stride_bit_exact_in_place() -> None:
    model = Strided()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 8)).sum().backward()
    opt.step()
    ring = SnapshotRing(1)
    snap = ring.take(model, [opt], step=1, log_step=1)
    live = [*model.parameters(), *model.buffers(), *(v for s in opt.state.values() for v in s.values())]
    before = [(t.clone(), t.stride(), t.data_ptr()) for t in live]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(8, 8)).sum().backward()
    opt.step()
    ring.restore(snap, model, [opt])
    for t, (value, stride, ptr) in zip(live, before, strict=True):
        assert torch.equal(t, value)
        assert (t.stride(), t.data_ptr()) == (stride, ptr)
    model.expanded = torch.full((), 5.0).expand(3)  # memory its elements share changes only by a new tensor
    ring.restore(snap, model, [opt])
    assert torch.equal(model.expanded, torch.ones(3))


def test_the_preset_trains_rolls_back_and_checkpoints_any_strides(tmp_path: Any) -> None:
    ck = tmp_path / "ck"
    fault = FaultInjector("param", steps=[5], param_name="mix")  # NaN into the transposed weight: a rollback
    callbacks = [
        ModelCheckpoint(dirpath=str(ck), save_last=True),
        *default_callbacks(AutoRollback={"every_n_steps": 2}),
        fault,
    ]
    model = Strided()
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=2, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(model)
    assert trainer.global_step == 16
    assert all_finite(model)
    assert "rollback" in [r.action for r in get_engine(trainer).sink.records]
    last = os.path.join(ck, "last.ckpt")
    assert verify_checkpoint(last).ok
    resumed = make_trainer(
        tmp_path,
        max_steps=-1,
        max_epochs=3,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=str(ck), save_last=True), *default_callbacks()],
    )
    resumed.fit(Strided(), ckpt_path=last)
    assert resumed.global_step == 24


def test_a_non_finite_stride0_parameter_is_found_in_a_checkpoint() -> None:
    model = Strided()
    with torch.no_grad():
        model.one.fill_(float("nan"))
    assert nonfinite_tensors({"state_dict": model.state_dict(), "optimizer_states": []}) == ["state_dict.one"]
