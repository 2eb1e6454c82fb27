"""AutoRollback under ModelParallelStrategy + FSDP2: local-shard snapshots, restored in place on every rank together."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.sharded._launch import run_ranks, run_ranks_many

pytestmark = pytest.mark.distributed


def _decisions(out: dict[str, Any], action: str) -> list[list[tuple[Any, ...]]]:
    return [
        [
            (i["step"], i["values"].get("restored_from_step"), i["cause"])
            for i in r["incidents"]
            if i["action"] == action
        ]
        for r in out["ranks"]
    ]


def test_damaged_shard_on_rank1_rolls_both_ranks_back_to_the_same_state(tmp_path: Any) -> None:
    # Rank 1's local shard of body.0.weight becomes NaN at the start of step 3; snapshots are taken at steps 0, 2, 4.
    fault = {"target": "param", "steps": [3], "ranks": [1]}
    config = {"max_steps": 6, "fault": fault, "monitor": {"forensics": "off"}}
    # The reference (below): the clean run with the updates of steps 2 and 3 dropped; both in one launch.
    faulty, reference = run_ranks_many(
        [
            ({**config, "rollback": {"every_n_steps": 2, "quiet_steps": 0}}, str(tmp_path / "faulty")),
            ({"max_steps": 6, "drop_steps": [2, 3]}, str(tmp_path / "ref")),
        ]
    )
    rollbacks = _decisions(faulty, "rollback")
    assert rollbacks[0] == rollbacks[1] == [(3, 2, "corrupt_state")]  # same step, same snapshot, on both ranks
    for rank in faulty["ranks"]:
        assert [row["dropped"] for row in rank["steps"]] == [False, False, False, True, False, False]
    # Restoring the step-2 snapshot undoes step 2's update, and step 3's poisoned update was dropped: the result is
    # the clean run with the updates of steps 2 and 3 dropped, bit for bit (parameters and AdamW state alike, or
    # the later steps would differ).
    got, want = faulty["params"], reference["params"]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert torch.equal(got[name], want[name]), f"{name}: max diff {(got[name] - want[name]).abs().max()}"


def test_spike_in_rank1_shard_rolls_back_and_backs_off_on_both_ranks(tmp_path: Any) -> None:
    # Rank 1's local gradient shard is multiplied by 1e4 at step 4: only the reduced norm shows the spike on rank 0.
    fault = {"target": "grad", "steps": [4], "ranks": [1], "value": 1e4}
    monitor = {"forensics": "off", "spike_zscore": 3.0, "spike_warmup": 3, "on_spike": "rollback"}
    config = {
        "max_steps": 6,
        "fault": fault,
        "monitor": monitor,
        "rollback": {"every_n_steps": 2, "quiet_steps": 0},
        "backoff": {},
    }
    out = run_ranks(config, str(tmp_path))
    incidents = [
        [(i["step"], i["trigger"], i["actions"], i["values"].get("restored_from_step")) for i in r["incidents"]]
        for r in out["ranks"]
    ]
    assert incidents[0] == incidents[1] == [(4, "grad_norm_spike", ["skip", "rollback", "backoff"], 4)]
    rows = [rank["steps"] for rank in out["ranks"]]
    assert rows[0] == rows[1]  # the same norms, drops and learning rates on both ranks
    assert [row["dropped"] for row in rows[0]] == [False, False, False, False, True, False]
    assert rows[0][4]["grad_norm"] > 100 * rows[0][3]["grad_norm"]
    assert [row["lr"] for row in rows[0]] == pytest.approx([0.02] * 4 + [0.01] * 2)  # OptimizerBackoff, once
    assert all(torch.isfinite(p).all() for p in out["params"].values())
