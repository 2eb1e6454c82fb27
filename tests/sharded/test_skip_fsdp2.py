"""A non-finite gradient in one rank's shard drops the update on every rank (ModelParallelStrategy + FSDP2)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.sharded._launch import run_ranks_many

pytestmark = pytest.mark.distributed


OPTIMIZERS = ["adamw", "adamw_fused", "sgd"]
STEPS = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Per optimizer, the faulty run and its reference, all six in one launch of the 2 ranks."""
    root = tmp_path_factory.mktemp("skip_fsdp2")
    fault = {"target": "grad", "steps": [2], "ranks": [1]}  # rank 1's local shard of body.0.weight only
    plan: list[tuple[dict[str, Any], str]] = []
    for optimizer in OPTIMIZERS:
        # LossScaleWatchdog rides along: no GradScaler under ModelParallelStrategy, so it must join and change nothing.
        faulty = {"max_steps": STEPS, "optimizer": optimizer, "fault": fault, "monitor": {}, "watchdog": True}
        # The reference: the same run without the fault, whose step 2 update is dropped by the test on every rank.
        reference = {"max_steps": STEPS, "optimizer": optimizer, "drop_steps": [2]}
        plan += [(faulty, str(root / optimizer / "faulty")), (reference, str(root / optimizer / "ref"))]
    out = run_ranks_many(plan, timeout=150.0)
    return {opt: (out[2 * i], out[2 * i + 1]) for i, opt in enumerate(OPTIMIZERS)}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_nan_in_rank1_shard_is_skipped_on_both_ranks(
    runs: dict[str, tuple[dict[str, Any], dict[str, Any]]], optimizer: str
) -> None:
    faulty, reference = runs[optimizer]
    decisions = [[(i["step"], i["action"], i["ranks"]) for i in r["incidents"]] for r in faulty["ranks"]]
    assert decisions[0] == decisions[1] == [(2, "skip", [1])]  # one reduced decision, rank 1 named
    for rank in faulty["ranks"]:
        assert rank["skipped_steps"] == 1
        rows = {row["step"]: row for row in rank["steps"]}
        assert math.isnan(rows[2]["grad_norm"])
        assert rows[2]["dropped"]
        assert all(math.isfinite(rows[s]["grad_norm"]) for s in rows if s != 2)
    got, want = faulty["params"], reference["params"]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"
