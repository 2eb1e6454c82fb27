"""What the checks read of each kind of tensor: sparse tensors through their stored values, a lazy module's
uninitialized parameters not at all, complex ones through their real view."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_nanguard.signals.model_tensors import model_tensors, nonfinite_names, watched_buffers
from lightning_nanguard.signals.stored import stored_values
from lightning_nanguard.signals.tensors import all_finite


def _coo(values: list[float]) -> torch.Tensor:
    idx = [list(range(len(values))), list(range(len(values)))]
    return torch.sparse_coo_tensor(idx, values, (4, 4), check_invariants=True)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_sparse_tensors_are_checked_through_their_stored_values() -> None:
    assert bool(all_finite([_coo([1.0, 2.0]), _coo([3.0]).to_sparse_csr()]))
    assert not bool(all_finite([_coo([1.0, float("nan")])]))
    assert not bool(all_finite([_coo([float("inf")]).to_sparse_csr()], wide=True))
    values = stored_values(_coo([1.0, 2.0]))
    assert values is not None
    assert values.layout is torch.strided


def test_uninitialized_parameters_are_left_out_until_materialized() -> None:
    model = nn.Sequential(nn.LazyLinear(2), nn.LazyBatchNorm1d())
    assert stored_values(model[0].weight) is None
    assert [n for n, _ in model_tensors(model)] == ["1.num_batches_tracked"]  # an ordinary buffer
    assert watched_buffers(model) == []
    assert nonfinite_names(model) == []
    assert bool(all_finite(list(model.parameters())))
    model(torch.randn(3, 5))
    assert [n for n, _ in model_tensors(model)][:2] == ["0.weight", "0.bias"]
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert nonfinite_names(model) == ["0.weight"]


def test_a_sparse_buffer_is_named_when_it_holds_a_nan() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("adj", _coo([1.0, float("nan")]))
    assert nonfinite_names(model) == ["adj"]
    assert len(watched_buffers(model)) == 1
