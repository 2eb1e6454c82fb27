"""An incident's walk stays short: a NaN input row, detected, diagnosed, decided, quarantined and reported, through
at most 18 package files (``tools/incident_walk.py`` says how they are counted; ARCHITECTURE.md, "The incident
walk")."""

from __future__ import annotations

import importlib.util
import pathlib

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "incident_walk.py"


def test_a_nan_input_row_walks_at_most_18_files() -> None:
    spec = importlib.util.spec_from_file_location("incident_walk", TOOL)
    assert spec is not None
    assert spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    records, milestones, ran = tool.measure()
    assert [(r.step, str(r.cause)) for r in records] == [(tool.BAD_STEP, "input_data")]
    assert "policies/remedy.py" in ran  # the incident's own work, not the healthy step's
    walked = tool.walked_files(milestones)
    assert len(walked) <= 18, walked
