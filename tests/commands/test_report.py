"""``nanguard report``: a run's incidents, "no incidents" for a clean run (exit 0), exit 2 only where no log is."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor, cli, default_callbacks
from lightning_nanguard.engine.sink import INCIDENTS_FILE, SUMMARY_FILE
from lightning_nanguard.reporting.incidents import Incident, IncidentLog
from lightning_nanguard.reporting.summary import FACTS_FILE
from lightning_nanguard.testing import FaultInjector
from tests.fuzz import DEEP_JSON, damaged_bytes, wrong_types
from tests.helpers import TinyModel, make_trainer


def _log(path: pathlib.Path, n: int) -> pathlib.Path:
    log = IncidentLog(str(path))
    for step in range(n):
        log.add(
            Incident(
                step=step,
                epoch=0,
                batch_idx=step,
                ranks=[0],
                trigger="nonfinite_grads",
                action="skip",
                source="GradNormMonitor, AutoRollback",
                actions=["skip"],
                cause="bad_input",
                where=f"batch {step} rows [0]",  # 14 different samples: 14 records (not one recurring incident)
            )
        )
    return path


def test_report_of_a_run_with_incidents(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    callbacks = [FaultInjector("loss", steps=[2]), GradNormMonitor()]
    trainer = make_trainer(tmp_path, logger=logger, callbacks=callbacks, max_steps=4)
    trainer.fit(TinyModel())
    assert cli.main(["report", trainer.log_dir or ""]) == 0
    out = capsys.readouterr().out
    assert "nanguard summary (GradNormMonitor)" in out
    assert "incidents: 1 " in out
    assert "step       2" in out


def test_report_of_a_clean_run_says_no_incidents(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = make_trainer(tmp_path, logger=logger, callbacks=[GradNormMonitor()], max_steps=2)
    trainer.fit(TinyModel())
    assert cli.main(["report", trainer.log_dir or ""]) == 0
    assert "no incidents" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["summary_only", "nanguard_dir_only", "empty_log"])
def test_report_exits_zero_without_incidents(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    nanguard = tmp_path / os.path.dirname(INCIDENTS_FILE)
    nanguard.mkdir()
    if what == "summary_only":  # the summary points to an incidents.jsonl that a clean run never wrote
        (tmp_path / SUMMARY_FILE).write_text("nanguard summary (GradNormMonitor)\nno incidents: ...\n")
    elif what == "empty_log":
        (tmp_path / INCIDENTS_FILE).write_text("")
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no incidents")
    if what == "summary_only":
        assert "nanguard summary (GradNormMonitor)" in out
    if what == "empty_log":
        assert cli.main(["report", str(tmp_path / INCIDENTS_FILE)]) == 0  # the file itself, too
        assert "no incidents" in capsys.readouterr().out


def test_report_exits_two_where_there_is_no_log(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no nanguard log in" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert "no incident log at" in capsys.readouterr().err


def test_report_limit_zero_lists_every_incident(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _log(tmp_path / "incidents.jsonl", 14)
    assert cli.main(["report", "--limit", "0", str(path)]) == 0
    out = capsys.readouterr().out
    assert "more ..." not in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("  step")] == [str(s) for s in range(14)]
    assert "nanguard summary (AutoRollback, GradNormMonitor)" in out  # each source once
    assert cli.main(["report", "--limit", "4", str(path)]) == 0
    out = capsys.readouterr().out
    assert "... 10 more ..." in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("  step")] == ["0", "1", "12", "13"]


def test_report_limit_must_not_be_negative(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["report", "--limit", "-1", str(_log(tmp_path / "incidents.jsonl", 1))])
    assert info.value.code == 2
    assert "0 lists every incident" in capsys.readouterr().err


# repro: report_crashes_on_truncated_incident_log.py
def test_report_reads_a_log_whose_last_line_a_killed_run_cut_short(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _log(tmp_path / INCIDENTS_FILE, 2)
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # the second record was half written when the run was killed
    assert cli.main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "incidents: 1 " in captured.out  # the intact record is reported
    assert f"{path}:2: the last line is cut short (the run was killed while writing it): skipped" in captured.err


def test_report_leaves_out_a_line_that_is_no_incident_record_with_a_note(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _log(tmp_path / INCIDENTS_FILE, 2)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + '{"step": 1}\n' + lines[1])
    assert cli.main(["report", str(path)]) == 0
    captured = capsys.readouterr()
    assert "incidents: 2 " in captured.out
    assert f"{path}:2: not an incident record" in captured.err


class _BadRowModel(TinyModel):
    """TinyModel trained on 32 rows of which row 13 holds a NaN feature: a bad record the preset quarantines."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        x[13, 2] = float("nan")
        return DataLoader(TensorDataset(x, x[:, :1] * 0.5), batch_size=8)


def test_report_agrees_with_the_runs_own_summary(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``nanguard report RUN`` prints what the end of fit printed: every installed callback in the header, the
    quarantine line, the final-weights line (from ``summary.json``, beside the summary)."""
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = make_trainer(tmp_path, logger=logger, callbacks=default_callbacks(), max_steps=-1, max_epochs=2)
    trainer.fit(_BadRowModel())
    log_dir = trainer.log_dir or ""
    own = (pathlib.Path(log_dir) / SUMMARY_FILE).read_text(encoding="utf-8")
    assert "quarantine" in own
    assert "final parameters and buffers" in own
    assert own.splitlines()[0].count(",") == len(default_callbacks()) - 1  # every callback installed is named
    capsys.readouterr()
    assert cli.main(["report", log_dir]) == 0
    assert capsys.readouterr().out == own
    assert cli.main(["report", os.path.join(log_dir, INCIDENTS_FILE)]) == 0  # the log itself: the same summary
    assert capsys.readouterr().out == own


@pytest.mark.parametrize("contents", [b"\xff\xfe{", b"[1, 2]", b'{"version": 1, "callbacks": "GradNormMonitor"}', b""])
def test_report_of_a_damaged_summary_json_falls_back_to_the_records(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], contents: bytes
) -> None:
    """A ``summary.json`` holding anything (cut short, another type, other bytes) is a note, not a traceback: the
    header then names the callbacks the incidents came from."""
    (tmp_path / "nanguard").mkdir()
    _log(tmp_path / INCIDENTS_FILE, 1)
    (tmp_path / SUMMARY_FILE).write_text("nanguard summary (GradNormMonitor, AutoRollback)\n", encoding="utf-8")
    (tmp_path / FACTS_FILE).write_bytes(contents)
    assert cli.main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("nanguard summary (AutoRollback, GradNormMonitor)")
    assert "summary.json" in captured.err


def _facts() -> bytes:
    from lightning_nanguard.reporting.summary import RunFacts

    facts = RunFacts(("GradNormMonitor", "AutoRollback"), final_state="finite", notes=("quarantined: 1",), steps=4)
    return facts.to_json().encode()


@pytest.mark.parametrize(
    "case",
    sorted(
        [f"bytes: {k}" for k in damaged_bytes(_facts())]
        + [f"json: {k}" for k in wrong_types(json.loads(_facts()))]
        + [f"deep: {k}" for k in DEEP_JSON]
    ),
)
def test_any_summary_json_gets_a_verdict(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    """Whatever ``summary.json`` holds, ``nanguard report`` prints a summary (the run's, or from the records with a
    note), never a traceback."""
    kind, name = case.split(": ", 1)
    if kind == "bytes":
        content = damaged_bytes(_facts())[name]
    elif kind == "json":
        content = json.dumps(wrong_types(json.loads(_facts()))[name]).encode()
    else:
        content = DEEP_JSON[name].encode()
    (tmp_path / "nanguard").mkdir()
    _log(tmp_path / INCIDENTS_FILE, 1)
    (tmp_path / SUMMARY_FILE).write_text("nanguard summary (GradNormMonitor)\n", encoding="utf-8")
    (tmp_path / FACTS_FILE).write_bytes(content)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nanguard summary (")
    assert "incidents: 1" in out
