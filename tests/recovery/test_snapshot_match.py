"""SnapshotRing against a module that changed since the snapshot: entries matched by name, a reshaped buffer
reallocated at the snapshot's shape, sparse tensors kept and restored, a parameter materialized later refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nanguard.recovery.snapshot import SnapshotRing
from lightning_nanguard.recovery.snapshot_match import SnapshotMismatch


class Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.arange(4.0), persistent=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


def test_a_buffer_registered_again_larger_is_restored_at_the_snapshot_size() -> None:
    model = Cached()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = SnapshotRing(1)
    snap = ring.take(model, [opt], step=5, log_step=5)
    weight = model.lin.weight.detach().clone()
    model.register_buffer("cache", torch.arange(8.0), persistent=False)  # grew
    with torch.no_grad():
        model.lin.weight.fill_(float("nan"))
    assert ring.mismatch(snap, model, [opt]) is None
    ring.restore(snap, model, [opt])
    assert torch.equal(model.cache, torch.arange(4.0))
    assert torch.equal(model.lin.weight, weight)
    assert "cache" not in model.state_dict()  # still non-persistent
    # The next snapshot follows the grown tensor again.
    model.register_buffer("cache", torch.arange(8.0), persistent=False)
    again = ring.take(model, [opt], step=6, log_step=6)
    model.cache.zero_()
    ring.restore(again, model, [opt])
    assert torch.equal(model.cache, torch.arange(8.0))


def test_a_buffer_added_after_the_snapshot_is_left_and_a_removed_one_is_skipped() -> None:
    model = Cached()
    ring = SnapshotRing(1)
    snap = ring.take(model, [], step=0, log_step=0)
    model.register_buffer("late", torch.ones(3))
    del model.count
    ring.restore(snap, model, [])
    assert torch.equal(model.late, torch.ones(3))
    assert not hasattr(model, "count")


def test_a_parameter_materialized_after_the_snapshot_makes_it_unusable() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ring = SnapshotRing(1)
    snap = ring.take(model, [opt], step=0, log_step=0)  # the lazy layer holds nothing yet: left out
    model(torch.randn(2, 3))
    reason = ring.mismatch(snap, model, [opt])
    assert reason is not None
    assert "0.weight" in reason
    with pytest.raises(SnapshotMismatch):
        ring.restore(snap, model, [opt])
    materialized = ring.take(model, [opt], step=1, log_step=1)
    assert ring.mismatch(materialized, model, [opt]) is None


def test_sparse_buffers_and_sparse_optimizer_state_are_kept_and_restored() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    adj = torch.sparse_coo_tensor([[0, 1], [1, 0]], [0.5, 0.25], (2, 2), check_invariants=True).coalesce()
    emb.register_buffer("adj", adj)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    emb(torch.tensor([1, 2, 2])).sum().backward()
    opt.step()
    ring = SnapshotRing(1)
    snap = ring.take(emb, [opt], step=1, log_step=1)
    momentum = opt.state[emb.weight]["momentum_buffer"].coalesce().to_dense().clone()
    weight = emb.weight.detach().clone()
    emb.adj = torch.sparse_coo_tensor([[0], [0]], [float("nan")], (2, 2), check_invariants=True)
    emb.zero_grad()
    emb(torch.tensor([7])).sum().backward()
    opt.step()
    assert bool(SnapshotRing.state_finite(snap))
    ring.restore(snap, emb, [opt])
    assert torch.equal(emb.adj.to_dense(), adj.to_dense())
    assert torch.equal(emb.weight, weight)
    restored = opt.state[emb.weight]["momentum_buffer"]
    assert restored.is_sparse
    assert torch.equal(restored.coalesce().to_dense(), momentum)


def test_a_lazy_layer_asks_for_one_more_snapshot_only_while_it_materializes() -> None:
    model = nn.ModuleDict({"used": nn.LazyLinear(2), "unused": nn.LazyLinear(2)})
    ring = SnapshotRing(2)
    ring.take(model, [], step=0, log_step=0)
    assert ring.incomplete  # the next batch start snapshots again
    model["used"](torch.randn(1, 3))
    ring.take(model, [], step=1, log_step=1)
    assert ring.incomplete  # one of the two materialized: once more
    ring.take(model, [], step=2, log_step=2)
    assert not ring.incomplete  # nothing more materialized: the unused layer never will
