"""The origin tracer's bounds and hygiene: it leaves nothing behind, stops at its budget, and never breaks a pass."""

from __future__ import annotations

import math
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from lightning_nanguard.forensics import bundle as bundle_module
from lightning_nanguard.forensics.bundle import read_bundle, write_bundle
from lightning_nanguard.forensics.origin import OriginTracer
from lightning_nanguard.forensics.replay import trace_pass
from tests.forensics import origin_models as m

TRAINER = SimpleNamespace(precision_plugin=Precision())


def _bad_batch(model: Any) -> Any:
    return next(b for i, b in enumerate(model.train_dataloader()) if i == m.BAD_BATCH)


def test_a_traced_pass_leaves_nothing_behind() -> None:
    model = m.NormNoEps()
    batch = _bad_batch(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    traced = trace_pass(TRAINER, model, batch, m.BAD_BATCH)
    assert traced.origin is not None
    assert not torch.is_anomaly_enabled()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    x = torch.ones(2)
    assert torch.equal(x / x, torch.ones(2))  # no mode left on the stack: ops run untraced (and unchecked)


def test_the_trace_stops_at_max_ops() -> None:
    model = m.NormNoEps()
    traced = trace_pass(TRAINER, model, _bad_batch(model), m.BAD_BATCH, max_ops=3)
    assert traced.result.reproduced  # the pass itself ran to the end
    assert traced.origin is None
    assert traced.note == "stopped after max_ops=3 ops"


def test_an_origin_without_a_module_or_a_trainer() -> None:
    """The tracer works on plain tensors: 0 * log(0) inside a loss, the log named."""
    w = nn.Parameter(torch.tensor([1.0, 0.0]))
    with OriginTracer() as tracer:
        p = w * 1.0
        loss = (p * torch.log(p)).sum()
        (grad,) = torch.autograd.grad(loss, [w])
    origin = tracer.origin([loss, grad])
    assert origin is not None
    assert (origin.op, origin.phase, origin.produced) == ("aten.log.default", "forward", "inf")
    assert origin.surfaced_op == "aten.mul.Tensor"


def test_a_healthy_pass_with_infinities_has_no_origin() -> None:
    w = nn.Parameter(torch.randn(3, 4))
    with OriginTracer() as tracer:
        scores = w.masked_fill(torch.tensor([True, False, False, False]), -math.inf)
        loss = torch.logsumexp(scores, dim=-1).sum() + torch.exp(torch.tensor(-math.inf))
        (grad,) = torch.autograd.grad(loss, [w])
    assert tracer.origin([loss, grad]) is None


Pair = namedtuple("Pair", ["x", "y"])


def test_a_named_tuple_batch_round_trips_and_an_object_needs_pickle(tmp_path: Path) -> None:
    model = m.NormNoEps()
    x, y = _bad_batch(model)
    written = write_bundle(str(tmp_path), TRAINER, model, Pair(x, y), m.BAD_BATCH, name="pair")
    assert written.path is not None
    batch = read_bundle(written.path).batch
    # A named tuple of the same name and fields, made by the reader: a bundle never imports the class it names.
    assert (type(batch).__name__, batch._fields) == ("Pair", ("x", "y"))
    assert type(batch) is not Pair
    assert torch.equal(batch.x, x)

    written = write_bundle(str(tmp_path), TRAINER, model, {"x": x, "meta": object()}, m.BAD_BATCH, name="obj")
    assert written.path is not None
    assert "pickle" in written.reason
    with pytest.raises(bundle_module.BundleError, match="allow-pickle"):
        read_bundle(written.path)
    assert torch.equal(read_bundle(written.path, allow_pickle=True).batch["x"], x)


def test_no_bundle_when_the_disk_is_nearly_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = m.NormNoEps()
    free = SimpleNamespace(total=10 << 30, used=10 << 30, free=100 << 20)
    monkeypatch.setattr(bundle_module.shutil, "disk_usage", lambda _: free)
    written = write_bundle(str(tmp_path), TRAINER, model, _bad_batch(model), m.BAD_BATCH)
    assert written.path is None
    assert "100 MB free" in written.reason


def test_a_buffer_mask_of_minus_inf_is_intended_not_a_corrupt_state() -> None:
    """A registered mask buffer of -inf that fully masks one row: the softmax is the origin, not the buffer."""
    from lightning_nanguard.policies.causes import explain

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            mask = torch.zeros(4, 4)
            mask[2, :] = -math.inf
            self.register_buffer("mask", mask)
            self.w = nn.Parameter(torch.randn(4, 4))

    model = Attention()
    with OriginTracer(model) as tracer:
        loss = torch.softmax(model.w + model.mask, dim=-1).sum()
        (grad,) = torch.autograd.grad(loss, [model.w])
    origin = tracer.origin([loss, grad])
    assert origin is not None
    assert (origin.op, origin.phase) == ("aten._softmax.default", "forward")
    assert explain(origin).kind == "fully_masked_softmax"
    assert "mask" in origin.note
