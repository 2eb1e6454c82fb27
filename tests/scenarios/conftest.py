"""One run per (task, configuration) per session, shared by the scenario tests that judge it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lightning_nanguard.demo import RunResult, preset, run_task

Runner = Callable[..., RunResult]


@pytest.fixture(scope="session")
def scenario_run(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """``scenario_run(task, config, devices=1)``: ``config`` is ``"healthy"``, ``"unguarded"`` or ``"preset"``."""
    root = str(tmp_path_factory.mktemp("scenarios"))
    cache: dict[tuple[Any, ...], RunResult] = {}

    def run(task: str, config: str, devices: int = 1) -> RunResult:
        key = (task, config, devices)
        if key not in cache:
            ddp: dict[str, Any] = {"devices": 2, "strategy": "ddp_spawn"} if devices == 2 else {}
            callbacks = preset() if config == "preset" else []
            name = config if devices == 1 else f"{config}-ddp"
            cache[key] = run_task(
                task, callbacks, seed=0, root_dir=root, healthy=config == "healthy", config=name, **ddp
            )
        return cache[key]

    return run
