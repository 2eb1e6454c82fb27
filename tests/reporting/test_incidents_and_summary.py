from __future__ import annotations

import json
import math
from typing import Any

import pytest

from lightning_nanguard import NanGuardConfigError
from lightning_nanguard._validation import check_float
from lightning_nanguard.cli import main
from lightning_nanguard.reporting.incidents import Incident, IncidentLog
from lightning_nanguard.reporting.summary import format_summary


def _incident(step: int, action: str = "skip") -> Incident:
    return Incident(step, 0, step, [0], "nonfinite_loss", action, "GradNormMonitor", {"loss": math.nan, "g": 1.5}, 3)


def test_incident_log_writes_json_lines_with_nonfinite_values_as_strings(tmp_path: Any) -> None:
    log = IncidentLog(str(tmp_path / "sub" / "incidents.jsonl"))
    log.add(_incident(3))
    log.add(_incident(4, "stop"))
    lines = (tmp_path / "sub" / "incidents.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["values"] == {"loss": "nan", "g": 1.5}
    assert [r.step for r in IncidentLog.read(str(tmp_path / "sub" / "incidents.jsonl"))] == [3, 4]
    assert log.counts() == {"skip": 1, "stop": 1}


def test_summary_is_short_and_names_counts() -> None:
    text = format_summary([_incident(i) for i in range(30)], ["GradNormMonitor"], "/x/incidents.jsonl")
    assert "incidents: 30 " in text
    assert "actions: skip=30" in text
    assert "... 22 more ..." in text
    assert len(text.splitlines()) < 20
    assert "no incidents" in format_summary([], ["GradNormMonitor"], None)


def test_summary_says_how_many_steps_were_checked() -> None:
    def clean(steps: int | None) -> str:
        return format_summary([], ["GradNormMonitor"], None, steps=steps).splitlines()[2]

    assert clean(12) == "no incidents: all 12 training steps were checked and were finite."
    assert clean(0) == "no incidents; no training step ran."  # a fit stopped before its first step
    assert clean(None) == "no incidents: every training step was checked and was finite."  # nanguard report


def test_cli_report(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    log = IncidentLog(str(tmp_path / "nanguard" / "incidents.jsonl"))
    log.add(_incident(7))
    assert main(["report", str(tmp_path)]) == 0
    assert "step       7" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"low": 0.0, "high": 1.0, "low_inclusive": False}, 0.0, r"X\(f=0.0\): must be a number in \(0.0, 1.0\]"),
        ({"low": 1.0}, float("nan"), r"X\(f=nan\): must be a number in \[1.0, inf\)"),
        ({}, "a", r"X\(f='a'\): must be a number"),
    ],
)
def test_check_float_messages(kwargs: dict[str, Any], value: Any, message: str) -> None:
    with pytest.raises(NanGuardConfigError, match=message):
        check_float("X", "f", value, **kwargs)


def test_an_incident_holds_typed_values_and_writes_the_plain_ones() -> None:
    from lightning_nanguard.contract import Action, Cause, Signal

    inc = Incident(3, 0, 3, [0], "nonfinite_loss", "skip", "GradNormMonitor", actions=["skip", "quarantine"])
    assert inc.trigger is Signal.NONFINITE_LOSS
    assert inc.action is Action.SKIP
    assert inc.actions == [Action.SKIP, Action.QUARANTINE]
    assert inc.cause is None
    typed = Incident(**{**inc.__dict__, "cause": "input_data"})
    assert typed.cause is Cause.INPUT_DATA
    assert f"{typed.cause} -> {', '.join(typed.actions)}" == "input_data -> skip, quarantine"
    record = typed.to_dict()
    assert (record["trigger"], record["action"], record["cause"]) == ("nonfinite_loss", "skip", "input_data")
    assert type(record["action"]) is str
    assert inc.to_dict()["cause"] == ""
    # A log written by another version: a value this one does not know stays a plain string.
    foreign = Incident.from_dict({**record, "trigger": "nonfinite_checkpoint", "cause": "bad_input"})
    assert (foreign.trigger, foreign.cause) == ("nonfinite_checkpoint", "bad_input")
