"""The share rule and the snapshot ring on hand-built DTensors (2 gloo ranks, no Lightning)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest

from tests.sharded._launch import run_module

pytestmark = pytest.mark.distributed


def test_shares_make_one_sum_the_global_norm_and_snapshots_round_trip_local_shards(tmp_path: Any) -> None:
    run_module("tests.sharded._dtensor_worker", [str(tmp_path)], timeout=80)
    results = []
    for r in (0, 1):
        with open(os.path.join(tmp_path, f"dtensor{r}.json"), encoding="utf-8") as f:
            results.append(json.load(f))
    assert results[0] == results[1]
    got = results[0]
    assert got["shares"] == [1.0, 0.5, 0.5]  # Shard(0) over 2 ranks; Replicate and plain: held twice, counted once
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got["norms"], got["expected"], strict=True))
    assert got["shard_buffer_shape"] == [3, 3]  # the snapshot holds this rank's (3, 3) shard of the (6, 3) tensor
    assert got["params_restored"]
    assert got["rebuilt_is_dtensor"]  # optimizer state missing at restore is rebuilt as a DTensor of its layout
    assert got["rebuilt_equal"]
