"""The side-stream snapshot copy on CUDA: restorable only once its copy completed, read before the next update
changes the state (the update waits for the copy on the GPU), into page-locked buffers of exactly the size needed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard.recovery.snapshot import SnapshotRing
from tests.gpu._helpers import gpu, needs_cuda

pytestmark = [*gpu, needs_cuda]


class OneProcess:
    """What ``SnapshotRing.prepare`` reads of a Trainer, for one process."""

    world_size = 1
    global_rank = 0
    strategy = None


def _setup(width: int = 2048, depth: int = 8) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    # 33.6M parameters: 400 MB of parameters and AdamW state, a copy of several milliseconds.
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)], nn.BatchNorm1d(width)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt, torch.randn(32, width, device="cuda")


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    return out + [v.clone() for s in opt.state.values() for v in s.values()]


@pytest.mark.parametrize("closure", [False, True], ids=["step", "step-closure"])
def test_a_snapshot_is_restorable_once_copied_and_holds_the_state_before_the_update(closure: bool) -> None:
    model, opt, x = _setup()
    _loss(model, x)
    opt.step()
    opt.zero_grad()
    ring = SnapshotRing(2, pin_memory=True)
    ring.prepare(OneProcess(), model, [opt])  # type: ignore[arg-type]
    before = _state(model, opt)
    torch.cuda._sleep(2_000_000_000)  # the training stream is busy ~1 s: the side stream's copy waits behind it
    snap = ring.take(model, [opt], step=1, log_step=1)
    assert not snap.ready()  # its copy cannot even have started
    # The next step, queued right away: forward and backward may run while the copy runs; the update (and the
    # forward's BatchNorm statistics, copied on the training stream first) must not change what the copy reads.
    if closure:
        opt.step(lambda: _loss(model, x))  # Lightning's way: forward and backward inside the step
    else:
        _loss(model, x)
        opt.step()
    opt.zero_grad()
    changed = _state(model, opt)
    assert not all(torch.equal(a, b) for a, b in zip(changed, before, strict=True))
    ring.restore(snap, model, [opt])  # waits for the copy
    assert snap.ready()
    assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), before, strict=True))
    assert snap.layout is not None
    assert snap.flat is not None
    assert snap.flat.is_pinned()
    assert snap.flat.numel() == snap.layout.slot_bytes  # pinned at its exact size (no power-of-two rounding)
    ring.clear()


def test_healthy_steps_after_a_completed_copy_do_not_wait(monkeypatch: Any) -> None:
    model, opt, x = _setup(width=256, depth=2)
    _loss(model, x)
    opt.step()
    ring = SnapshotRing(1, pin_memory=True)
    ring.prepare(OneProcess(), model, [opt])  # type: ignore[arg-type]
    ring.take(model, [opt], step=1, log_step=1)
    torch.cuda.synchronize()
    side = ring._side
    assert side is not None
    waits: list[Any] = []
    monkeypatch.setattr(side, "_wait", waits.append)
    for _ in range(3):
        _loss(model, x)
        opt.step()
    assert waits == []  # the copy was seen complete: no GPU-side wait, and the hook returns at once from then on
    assert side.pending is None
    ring.clear()
    assert side._handles == []  # the hooks are gone with the ring's buffers
