"""SnapshotRing: bit-exact restore, no aliasing, buffer reuse, and lazily created optimizer state."""

from __future__ import annotations

import torch
from torch import nn

from lightning_nanguard.recovery.snapshot import SnapshotRing


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    return out + [v.clone() for s in opt.state.values() for v in s.values()]


def test_restore_is_bit_exact_and_never_aliases_the_snapshot() -> None:
    model, opt = _setup()
    _step(model, opt)
    ring = SnapshotRing(2)
    snap = ring.take(model, [opt], step=1, log_step=1)
    before = _state(model, opt)
    _step(model, opt)
    ring.restore(snap, model, [opt])
    assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), before, strict=True))
    _step(model, opt)  # must not write through into the snapshot
    ring.restore(snap, model, [opt])
    assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), before, strict=True))


def test_buffers_are_reused_and_the_oldest_slot_is_overwritten() -> None:
    model, opt = _setup()
    _step(model, opt)
    ring = SnapshotRing(2)
    a = ring.take(model, [opt], step=1, log_step=1)
    buffers = [t.data_ptr() for t in a.model + a.opt]
    ring.take(model, [opt], step=2, log_step=2)
    c = ring.take(model, [opt], step=3, log_step=3)
    assert c is a
    assert [t.data_ptr() for t in c.model + c.opt] == buffers
    assert ring.steps() == [2, 3]
    ring.discard_newer(2)
    assert ring.steps() == [2]


def test_restoring_a_snapshot_from_before_the_first_step_clears_optimizer_state() -> None:
    model, opt = _setup()
    ring = SnapshotRing(1)
    snap = ring.take(model, [opt], step=0, log_step=0)  # AdamW has no state yet
    initial = [t.detach().clone() for t in model.state_dict().values()]
    _step(model, opt)
    ring.restore(snap, model, [opt])
    assert len(opt.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial, strict=True))
    _step(model, opt)  # the optimizer starts over cleanly
    assert int(next(iter(opt.state.values()))["step"]) == 1


def test_state_finite_sees_a_poisoned_snapshot() -> None:
    model, opt = _setup()
    _step(model, opt)
    ring = SnapshotRing(1)
    snap = ring.take(model, [opt], step=1, log_step=1)
    assert bool(ring.state_finite(snap))
    snap.opt[0].view(-1)[0] = float("nan")
    assert not bool(ring.state_finite(snap))
