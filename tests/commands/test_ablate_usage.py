"""``nanguard ablate``: a wrong command line is a usage error (exit 2) found before anything runs, and the table says
what "finished" means and why a run did not finish."""

from __future__ import annotations

import math
import pathlib

import pytest

from lightning_nanguard import cli
from lightning_nanguard.commands import ablate
from lightning_nanguard.commands.table import Row, markdown
from lightning_nanguard.preset import CALLBACKS


# repro: ablate_unknown_config_exit0.py
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--configs", "GradNormMonitr"],
            "unknown configuration(s) 'GradNormMonitr' in --configs; the known ones: none",
        ),
        (["--configs", "none,al"], "unknown configuration(s) 'al' in --configs"),
        (["--task", "nosuch"], "unknown --task ['nosuch']"),
        (["--entry", "missing_train.py", "--yaml", "a.yaml"], "no such file: missing_train.py, a.yaml"),
        (["--entry", "missing_train.py"], "--entry needs --yaml"),
    ],
)
def test_a_wrong_command_line_is_a_usage_error_before_anything_runs(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "out"
    assert cli.main(["ablate", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not out.exists()  # nothing ran, nothing written


def test_the_table_shows_why_a_run_did_not_finish() -> None:
    rows = [
        Row("t", "none", 0, finished=False, train_loss=math.nan),
        Row("t", "x", 0, finished=False, train_loss=0.1, val_loss=0.2),
        Row("t", "y", 0, finished=False, error="NonFiniteTrainingError: stopped at step 9\nmore"),
        Row("t", "all", 0, finished=True, train_loss=0.1, val_loss=0.2),
    ]
    table = markdown(rows).splitlines()
    assert table[0].endswith("| note |")
    assert table[2].endswith("| ended with a non-finite training loss |")
    assert table[3].endswith("| ended with non-finite weights |")
    assert table[4].endswith("| NonFiniteTrainingError: stopped at step 9 |")
    assert table[5].endswith("|  |")


@pytest.mark.parametrize("config", ablate.STABILIZERS)
def test_each_stabilizer_runs_alone(config: str) -> None:
    """``--configs X`` builds X alone, as the preset configures it, for every callback of the preset (the seventh,
    PrecisionHeadroom, included: it was neither accepted nor left out of the others)."""
    built = ablate._callbacks(config)
    assert [type(c).__name__ for c in built] == [config]


def test_precision_headroom_is_a_known_configuration(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert set(ablate.STABILIZERS) == {cls.__name__ for cls in CALLBACKS}
    # The task is wrong, the configuration is not: only the task is named (nothing runs either way).
    assert cli.main(["ablate", "--configs", "PrecisionHeadroom", "--task", "nosuch", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown --task" in err
    assert "unknown configuration" not in err
