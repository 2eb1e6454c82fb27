"""A checkpoint's sparse tensors (a graph's adjacency buffer, SGD's momentum for a sparse gradient) are checked
through the values they store, like every other tensor."""

from __future__ import annotations

import torch

from lightning_nanguard.checkpointing.verify import nonfinite_tensors


def _coo(value: float) -> torch.Tensor:
    return torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, value], (2, 2), check_invariants=True)


def test_a_nan_in_a_sparse_buffer_or_optimizer_state_is_found() -> None:
    checkpoint = {
        "state_dict": {"adj": _coo(float("nan")), "w": torch.ones(2)},
        "optimizer_states": [{"state": {0: {"momentum_buffer": _coo(float("inf"))}}}],
    }
    assert nonfinite_tensors(checkpoint) == ["state_dict.adj", "optimizer_states[0].state.0.momentum_buffer"]
    assert nonfinite_tensors({"state_dict": {"adj": _coo(2.0)}}) == []
