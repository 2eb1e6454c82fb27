"""The demo package itself: the registry, the table's formatting (no training here)."""

from __future__ import annotations

import math

import pytest

from lightning_nanguard.demo import CONFIGS, RunResult, get_task, preset, task_names
from lightning_nanguard.demo.table import format_table
from lightning_nanguard.preset import PRESET
from lightning_nanguard.reporting.incidents import Incident

TASKS = ["fp16-explosion", "eval-overflow", "eps-underflow", "corrupt-resume", "bad-data", "bn-poison"]


def test_every_task_is_registered_with_a_description_and_causes() -> None:
    assert set(TASKS) | {"spike-then-diverge"} <= set(task_names())
    for name in task_names():
        task = get_task(name)
        assert task.description
        assert task.failure
        assert task.causes
        assert task.max_epochs >= 1


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="bad-data"):
        get_task("no-such-task")


def test_configs_build_fresh_callbacks() -> None:
    assert CONFIGS["unguarded"]() == []
    first, second = preset(), preset()
    assert len(first) == len(PRESET)
    assert all(a is not b for a, b in zip(first, second, strict=True))


def _result(config: str, train: float, val: float, incidents: list[Incident], wall: float) -> RunResult:
    return RunResult(
        task="bad-data",
        config=config,
        healthy=config == "healthy",
        seed=0,
        finished=math.isfinite(train),
        error="",
        train_loss=train,
        val_loss=val,
        incidents_by_cause={"input_data": len(incidents)} if incidents else {},
        incidents=incidents,
        skipped_steps=len(incidents),
        rollbacks=0,
        steps_rolled_back=0,
        lr_scale=1.0,
        wall_time=wall,
        log_dir="",
        steps=96,
    )


def test_table_shows_ratios_to_the_healthy_run_and_the_preset_incidents() -> None:
    inc = Incident(0, 0, 9, [0], "nonfinite_loss", "quarantine", "GradNormMonitor", actions=["skip", "quarantine"])
    inc = Incident(**{**inc.__dict__, "cause": "input_data", "where": "batch 9 rows [12]"})
    grid = {
        "bad-data": [
            _result("healthy", 0.04, 0.05, [], 1.0),
            _result("unguarded", math.nan, math.nan, [], 0.9),
            _result("preset", 0.044, 0.05, [inc], 1.2),
        ]
    }
    text = format_table(grid)
    assert "| bad-data | unguarded | no (non-finite) | nan | nan | - | 0 | 1 | - | 0.90x (0.90s) |" in text
    cost = "1.10x; 1 dropped; 0 rolled back"  # the remedy cost: loss vs healthy, updates dropped, steps rolled back
    assert f"| bad-data | preset | yes | 1.10x | 1.00x | input_data=1 | 0 | 1 | {cost} | 1.20x (1.20s) |" in text
    assert "step 0: input_data -> skip, quarantine @ batch 9 rows [12]" in text
