"""GradNormMonitor under ModelParallelStrategy + FSDP2 (2 CPU ranks, gloo): the norm of sharded gradients is global."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.sharded._launch import run_ranks

pytestmark = pytest.mark.distributed


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_grad_norm_equals_the_full_tensor_norm_and_a_ddp_run(tmp_path: Any, precision: str) -> None:
    config = {"max_steps": 4, "monitor": {"forensics": "off"}, "precision": precision}
    sharded = run_ranks({**config, "strategy": "fsdp2"}, str(tmp_path / "fsdp2"))
    ddp = run_ranks({**config, "strategy": "ddp"}, str(tmp_path / "ddp"))
    r0, r1 = sharded["ranks"]
    assert r0["param_types"] == ["DTensor"]  # the gradients really were sharded
    assert r0["steps"] == r1["steps"]  # every number is rank-consistent
    assert len(r0["steps"]) == 4
    for row, ref_row in zip(r0["steps"], ddp["ranks"][0]["steps"], strict=True):
        reference = row["reference"]  # norms of the gathered full gradients of this very step
        assert _close(row["grad_norm"], reference["grad_norm"])
        assert _close(reference["current_grad_norm"], reference["grad_norm"])  # the on-demand global norm, too
        assert row["tensors"].keys() == reference["tensors"].keys()  # named by the original module paths
        assert all(_close(row["tensors"][n], v) for n, v in reference["tensors"].items())
        assert row["layers"].keys() == reference["layers"].keys() == {"body", "head"}
        assert all(_close(row["layers"][n], v) for n, v in reference["layers"].items())
        # The unsharded run (DDP, same model, data and seed) sees the same gradients, up to reduction order.
        assert _close(row["grad_norm"], ref_row["grad_norm"], rel=1e-4)
        assert _close(row["loss"], ref_row["loss"], rel=1e-4)
        assert all(_close(row["layers"][n], v, rel=1e-4) for n, v in ref_row["layers"].items())
