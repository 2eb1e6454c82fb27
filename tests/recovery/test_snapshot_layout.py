"""The snapshot's byte layout (who keeps which bytes under DDP), tensors with no byte view, and the host budget."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from lightning_nanguard import AutoRollback
from lightning_nanguard.exceptions import NanGuardConfigError
from lightning_nanguard.recovery import host_memory
from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.recovery.snapshot_budget import slots_that_fit
from lightning_nanguard.recovery.snapshot_layout import ALIGN, SHARED, TYPED, byte_view, plan_layout, spec_of
from tests.helpers import TinyModel, make_trainer


def _specs() -> list[Any]:
    tensors = [torch.randn(5, 7), torch.randn(3).to(torch.bfloat16), torch.tensor(2.0), torch.zeros(0), torch.randn(33)]
    return [spec_of(t, "param", True) for t in tensors] + [spec_of(torch.randn(4), "buffer", False)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ranks_chunks_cover_every_shared_byte_once_at_aligned_offsets(world: int) -> None:
    layouts = [plan_layout(_specs(), world, r, shard=True) for r in range(world)]
    first = layouts[0]
    assert first.chunk % ALIGN == 0
    assert first.chunk * world - first.shared_bytes < ALIGN * world  # at most the alignment over an equal split
    covered: dict[int, list[tuple[int, int]]] = {}
    for r, layout in enumerate(layouts):
        lo, hi = layout.own_range()
        assert (lo, hi) == (min(r * first.chunk, first.shared_bytes), min((r + 1) * first.chunk, first.shared_bytes))
        for p in layout.pieces(lo, hi):
            assert p.pos % ALIGN == 0  # every piece viewable in its own dtype
            covered.setdefault(p.index, []).append((p.start, p.end))
    for i, e in enumerate(first.entries):
        if e.region == SHARED and e.spec.nbytes:
            spans = sorted(covered[i])
            assert spans[0][0] == 0
            assert spans[-1][1] == e.spec.nbytes
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    # Buffers stay whole on each rank; one process shares nothing.
    assert first.entries[-1].region == "local"
    assert not plan_layout(_specs(), 1, 0, shard=True).sharded


class Odd(nn.Module):
    """A channels-last convolution weight (dense, not contiguous) and a strided buffer (not dense: no byte view)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)
        self.register_buffer("every_other", torch.randn(4, 8)[:, ::2])


def test_dense_and_strided_tensors_round_trip_bit_exact() -> None:
    model = Odd()
    assert byte_view(model.every_other) is None
    assert byte_view(model.conv.weight) is not None
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.conv(torch.randn(2, 3, 5, 5)).sum().backward()
    opt.step()
    ring = SnapshotRing(1)
    snap = ring.take(model, [opt], step=1, log_step=1)
    assert snap.layout is not None
    assert [e.region for e in snap.layout.entries].count(TYPED) == 1
    live = [*model.parameters(), *model.buffers()]
    before = [(t.clone(), t.stride(), t.data_ptr()) for t in live]
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.add_(1.0)
    ring.restore(snap, model, [opt])
    for t, (value, stride, ptr) in zip(live, before, strict=True):
        assert torch.equal(t, value)
        assert (t.stride(), t.data_ptr()) == (stride, ptr)  # in place, memory format kept


def test_the_budget_keeps_fewer_slots_or_refuses_naming_argument_value_and_rule() -> None:
    assert slots_that_fit(None, 10**9, 2, world=1, sharded=False) == 2
    assert slots_that_fit(300, 100, 2, world=1, sharded=False) == 2
    with pytest.warns(UserWarning, match=r"max_snapshot_bytes=150\) holds 1 of the 2 snapshots"):
        assert slots_that_fit(150, 100, 2, world=1, sharded=False) == 1
    with pytest.raises(NanGuardConfigError, match=r"AutoRollback\(max_snapshot_bytes=99\).*needs 100 bytes.*>= 100"):
        slots_that_fit(99, 100, 2, world=4, sharded=True)


@pytest.mark.parametrize("value", [0, -5, 1.5, "8GB", True])
def test_max_snapshot_bytes_is_an_int_or_none(value: Any) -> None:
    with pytest.raises(NanGuardConfigError, match=r"AutoRollback\(max_snapshot_bytes="):
        AutoRollback(max_snapshot_bytes=value)


def test_a_budget_too_small_for_one_snapshot_is_refused_at_train_start(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, callbacks=[AutoRollback(max_snapshot_bytes=100)])
    with pytest.raises(NanGuardConfigError, match=r"max_snapshot_bytes=100\): one snapshot .* needs \d+ bytes"):
        trainer.fit(TinyModel())


class RingBytes(TinyModel):
    """Reads the ring after the callbacks' hooks (a LightningModule's hook runs after them)."""

    def on_train_start(self) -> None:
        self.at_start = self.trainer.callbacks[0].ring.nbytes()  # type: ignore[attr-defined]

    def on_train_end(self) -> None:
        ring = self.trainer.callbacks[0].ring  # type: ignore[attr-defined]
        self.at_end, self.slots, self.snapshots = ring.nbytes(), len(ring.slots), ring.steps()


def test_slots_are_allocated_at_train_start_and_a_budget_for_one_keeps_one(tmp_path: Any) -> None:
    # TinyModel with AdamW: 161 parameters, 3 tensors of state each after the first step (sized before it).
    rollback = AutoRollback(every_n_steps=2, quiet_steps=0, max_snapshot_bytes=3000)
    model = RingBytes()
    trainer = make_trainer(tmp_path, callbacks=[rollback], max_steps=6)
    with pytest.warns(UserWarning, match="holds 1 of the 2 snapshots"):
        trainer.fit(model)
    assert model.at_start == model.at_end > 0  # nothing allocated inside the training steps
    assert (model.slots, model.snapshots) == (1, [4])


def test_a_forked_child_never_collects_the_parents_garbage() -> None:
    # The mechanism behind the DataLoader worker crash on CUDA (recovery/host_memory.py): garbage left by the parent
    # (here, a reference cycle whose finalizer says who ran it) must not be collected in a forked child.
    script = textwrap.dedent(
        """
        import gc, importlib.util, os, sys
        # The module alone (the package would import Lightning: seconds of this test's time).
        spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
        host_memory = importlib.util.module_from_spec(spec); spec.loader.exec_module(host_memory)

        def who_collects():
            r, w = os.pipe()

            class Cycle:
                def __del__(self):
                    os.write(w, b"%d " % os.getpid())

            a = Cycle(); a.self = a; del a
            pid = os.fork()
            if pid == 0:
                gc.collect()
                os._exit(0)
            os.waitpid(pid, 0)
            gc.collect()
            os.close(w)
            return "child" if b"%d" % pid in os.read(r, 100).split() else "parent"

        gc.disable()
        print(who_collects())
        host_memory.protect_forked_children()
        print(who_collects())
        """
    )
    path = host_memory.__file__
    out = subprocess.run(
        [sys.executable, "-c", script, path], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["child", "parent"]  # without the guard the child frees the parent's garbage; with it, never
