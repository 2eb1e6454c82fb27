from __future__ import annotations

import pytest

from tests.scenarios._runs import RunCache, Runner


@pytest.fixture(scope="session")
def scenario_run(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    """Runs each (task, configuration) once per session; see ``RunCache``."""
    return RunCache(str(tmp_path_factory.mktemp("scenarios")))
