"""GradNormMonitor under ModelParallelStrategy + FSDP2 (2 CPU ranks, gloo): the norm of sharded gradients is global."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.sharded._launch import run_ranks_many

pytestmark = pytest.mark.distributed


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


PRECISIONS = ["32-true", "bf16-mixed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (strategy, precision) one run; the runs of one strategy share one launch of the 2 ranks."""
    root = tmp_path_factory.mktemp("grad_norm_fsdp2")
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for strategy in ("fsdp2", "ddp"):
        plan = [
            (
                {"max_steps": 4, "monitor": {"forensics": "off"}, "precision": p, "strategy": strategy},
                str(root / f"{strategy}-{p}"),
            )
            for p in PRECISIONS
        ]
        out.update(zip([(strategy, p) for p in PRECISIONS], run_ranks_many(plan, timeout=120.0), strict=True))
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_grad_norm_equals_the_full_tensor_norm_and_a_ddp_run(
    runs: dict[tuple[str, str], dict[str, Any]], precision: str
) -> None:
    sharded, ddp = runs[("fsdp2", precision)], runs[("ddp", precision)]
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
