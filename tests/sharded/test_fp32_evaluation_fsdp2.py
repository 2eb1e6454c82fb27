"""FP32Evaluation under ModelParallelStrategy + FSDP2 (2 gloo CPU ranks): mode="always" under bf16-mixed."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.sharded._launch import run_module

pytestmark = pytest.mark.distributed


def _run(config: dict[str, Any], out_dir: str) -> list[dict[str, Any]]:
    os.makedirs(out_dir, exist_ok=True)
    run_module("tests.sharded._eval_worker", [json.dumps(config), out_dir], timeout=80.0)
    ranks = []
    for r in (0, 1):
        with open(os.path.join(out_dir, f"rank{r}.json"), encoding="utf-8") as f:
            ranks.append(json.load(f))
    return ranks


def test_always_evaluates_in_float32_on_both_ranks_under_bf16_mixed(tmp_path: Any) -> None:
    plain = _run({"precision": "bf16-mixed"}, str(tmp_path / "plain"))
    fp32 = _run({"precision": "bf16-mixed", "fp32_eval": {"mode": "always"}}, str(tmp_path / "fp32"))
    for rank in plain:  # the reference: Lightning evaluates under autocast, so the outputs are bfloat16
        assert (rank["error"], rank["val_dtypes"]) == ({}, ["bfloat16", "bfloat16"])
    for rank in fp32:  # every validation step of every rank ran with autocast off, and the run did not hang
        assert (rank["error"], rank["val_dtypes"]) == ({}, ["float32", "float32"])
    assert fp32[0]["val_loss"] == fp32[1]["val_loss"]
    assert fp32[0]["val_loss"] != plain[0]["val_loss"]  # computed in another precision
