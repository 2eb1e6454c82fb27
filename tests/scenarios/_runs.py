"""One run per (task, configuration, devices) per session, shared by the scenario tests that judge it."""

from __future__ import annotations

from typing import Any, Protocol

from lightning_nanguard.demo import RunResult, preset, run_task


class Runner(Protocol):
    def __call__(self, task: str, config: str, devices: int = 1, max_steps: int = -1) -> RunResult: ...


class RunCache:
    """``cache(task, config, devices=1)``: ``config`` is ``"healthy"``, ``"unguarded"``, ``"preset"`` or
    ``"preset-nofault"`` (the preset on the healthy task)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.results: dict[tuple[str, str, int], RunResult] = {}

    def __call__(self, task: str, config: str, devices: int = 1, max_steps: int = -1) -> RunResult:
        key = (task, config, devices, max_steps)
        if key not in self.results:
            ddp: dict[str, Any] = {"devices": 2, "strategy": "ddp_spawn"} if devices == 2 else {}
            callbacks = preset() if config.startswith("preset") else []
            name = config if devices == 1 else f"{config}-ddp"
            if max_steps >= 0:
                name = f"{name}-{max_steps}steps"
            healthy = config in ("healthy", "preset-nofault")
            self.results[key] = run_task(
                task, callbacks, seed=0, root_dir=self.root, healthy=healthy, config=name, max_steps=max_steps, **ddp
            )
        return self.results[key]
