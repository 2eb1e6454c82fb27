"""Recurring incidents are one record with a count: the log, its reading back, TensorBoard's text, the summary."""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

from lightning_nanguard.reporting.incidents import Incident, IncidentLog
from lightning_nanguard.reporting.summary import format_summary

WHERE = "the loss of training_step (every module output finite)"


def _incident(step: int, *, actions: tuple[str, ...] = ("skip",), where: str = WHERE) -> Incident:
    return Incident(
        step=step,
        epoch=0,
        batch_idx=step,
        ranks=[0],
        trigger="nonfinite_loss_and_grads",
        action=actions[-1] if actions[-1] != "skip" else "skip",
        source="GradNormMonitor",
        actions=list(actions),
        cause="loss_function",
        where=where,
        diagnosis={"module": ""},
    )


def test_repeats_of_one_cause_and_place_are_counted_in_the_first_record(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "incidents.jsonl"
    log = IncidentLog(str(path))
    assert log.add(_incident(3)) is None  # a new record
    for step in (5, 9, 14):
        repeat = log.add(_incident(step))
        assert repeat is not None
    assert log.add(_incident(20, where="batch 20 rows [1]")) is None  # another place: its own record
    assert log.add(_incident(21, actions=("skip", "stop"))) is None  # a stop is never folded in
    [first, other, stop] = log.records
    assert (first.step, first.count, first.repeats, first.last_step) == (3, 4, 3, 14)
    assert (other.count, stop.count) == (1, 1)
    assert log.counts() == {"skip": 5, "stop": 1}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 6  # one line per event, in order: the log stays truthful at any point
    assert lines[1] == {
        "cause": "loss_function",
        "repeat_of": 3,
        "repeats": 1,
        "step": 5,
        "trigger": "nonfinite_loss_and_grads",
        "where": WHERE,
    }
    read = IncidentLog.read(str(path))
    assert [(r.step, r.count, r.last_step) for r in read] == [(3, 4, 14), (20, 1, -1), (21, 1, -1)]


def _origin(where: str, *, data: bool) -> Incident:
    frame = {"file": "model.py", "line": 45, "function": "training_step"}
    origin = {"op": "aten.log.default", "frame": frame, "data_at_fault": data}
    return replace(_incident(0, where=where), diagnosis={"module": "", "origin": origin})


def test_a_formula_recurs_at_its_line_whatever_the_rows_bad_data_in_other_rows_is_another_place() -> None:
    # The origin names the op and line of the first NaN: another batch's rows meeting the same formula are the same
    # fault. Bad data's rows are its place: each batch's bad records are a record of their own.
    formula = [_origin("aten.log.default (forward) at model.py:45 in training_step, batch 2 rows [1]", data=False)]
    formula.append(_origin("aten.log.default (forward) at model.py:45 in training_step, batch 7 rows [3]", data=False))
    assert formula[0].recurring_key == formula[1].recurring_key
    data = [_origin(f"batch {b} rows [1]", data=True) for b in (2, 7)]
    assert data[0].recurring_key != data[1].recurring_key


def test_a_log_cut_after_some_repeats_reads_back_the_counts_up_to_there(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "incidents.jsonl"
    log = IncidentLog(str(path))
    for step in (3, 5, 9):
        log.add(_incident(step))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # killed while writing the third line
    records, notes = IncidentLog.read_checked(str(path))
    assert [(r.step, r.count, r.last_step) for r in records] == [(3, 2, 5)]
    assert "cut short" in notes[0]


def test_the_summary_says_how_often_between_which_steps_and_whether_it_kept_recurring() -> None:
    log = IncidentLog()
    for step in range(10, 100, 3):
        log.add(_incident(step))
    text = format_summary(log.records, ["GradNormMonitor"], None, end_step=100)
    assert "incidents: 30 in 1 record (loss_function=30)   actions: skip=30" in text
    assert "30 times between steps 10 and 97, still recurring when training ended: not fixed" in text
    early = format_summary(log.records, ["GradNormMonitor"], None, end_step=400)
    assert "30 times between steps 10 and 97, none in the last 303 steps" in early
    assert "30 times between steps 10 and 97" in format_summary(log.records, ["GradNormMonitor"], None)
