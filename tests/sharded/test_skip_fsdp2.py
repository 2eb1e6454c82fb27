"""A non-finite gradient in one rank's shard drops the update on every rank (ModelParallelStrategy + FSDP2)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.sharded._launch import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "sgd"])
def test_nan_in_rank1_shard_is_skipped_on_both_ranks(tmp_path: Any, optimizer: str) -> None:
    steps = 5
    fault = {"target": "grad", "steps": [2], "ranks": [1]}  # rank 1's local shard of body.0.weight only
    # LossScaleWatchdog rides along: no GradScaler under ModelParallelStrategy, so it must join and change nothing.
    config = {"max_steps": steps, "optimizer": optimizer, "fault": fault, "monitor": {}, "watchdog": True}
    faulty = run_ranks(config, str(tmp_path / "faulty"))
    # The reference: the same run without the fault, whose step 2 update is dropped by the test on every rank.
    reference = run_ranks({"max_steps": steps, "optimizer": optimizer, "drop_steps": [2]}, str(tmp_path / "ref"))
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
