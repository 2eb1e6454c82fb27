"""nanguard demo and nanguard ablate, run as a user runs them (the demo task is a real instability: a bad row)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lightning_nanguard.cli import main


def test_demo_shows_the_preset_saving_a_run_that_dies_without_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| bad-data | unguarded | 0 | NO | nan |" in out
    assert "| bad-data | preset | 0 | yes |" in out
    assert "input_data at batch" in out  # the incident names its cause and location
    assert f"tensorboard --logdir {os.path.join(tmp_path, 'bad-data')}" in out
    bundle = os.path.join(tmp_path, "bad-data", "preset-seed0", "nanguard", "bundles", "step-9")
    assert f"nanguard replay {bundle} --factory lightning_nanguard.demo:demo_module" in out  # it replays: README
    runs = sorted(os.listdir(os.path.join(tmp_path, "bad-data")))
    assert "preset-seed0" in runs
    assert "unguarded-seed0" in runs


def test_ablate_writes_the_table_one_process_per_run(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = str(tmp_path / "abl")
    assert main(["ablate", "--task", "bad-data", "--configs", "none,GradNormMonitor,all", "--out", out_dir]) == 0
    printed = capsys.readouterr().out
    assert "[3/3] bad-data all seed=0" in printed
    table = (tmp_path / "abl" / "ablation.md").read_text()
    rows = {line.split("|")[2].strip(): line for line in table.splitlines()[2:]}
    assert set(rows) == {"none", "GradNormMonitor", "all"}
    assert "| NO |" in rows["none"]
    assert "| yes |" in rows["all"]
    assert "input_data=1" in rows["all"]
    assert (tmp_path / "abl" / "ablation.csv").read_text().count("\n") == 4
    assert sorted(os.listdir(tmp_path / "abl" / "bad-data")) == ["GradNormMonitor-seed0", "all-seed0", "none-seed0"]


def test_unknown_task_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["demo", "--incident", "nope"])
    assert err.value.code == 2


def test_ablate_entry_finished_means_finite_weights_and_skips_count_without_gradnormmonitor(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # The shipped LightningCLI example has a NaN row: unguarded it exits 0 with NaN weights (not finished, and the
    # table says why); AutoRollback alone skips the bad steps, counted though no GradNormMonitor logs a counter.
    pytest.importorskip("jsonargparse")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    yamls = [os.path.join(root, "examples", "ablation", f"{n}.yaml") for n in ("none", "only_auto_rollback")]
    entry = os.path.join(root, "examples", "cli", "train.py")
    base = tmp_path / "base.yaml"
    base.write_text("trainer:\n  max_epochs: 1\n  enable_progress_bar: false\n  enable_model_summary: false\n")
    argv = ["ablate", "--entry", entry, "--base", str(base), "--yaml", *yamls, "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = {
        line.split("|")[2].strip(): line.split("|") for line in printed.splitlines() if line.startswith("| (entry)")
    }
    assert rows["none"][4].strip() == "NO"
    assert "the last training loss logged is nan" in rows["none"][12]
    assert rows["only_auto_rollback"][4].strip() == "yes"
    assert int(rows["only_auto_rollback"][8]) > 0  # skipped
    assert 'finished: "yes" when the run returned normally AND its final weights are finite' in printed
