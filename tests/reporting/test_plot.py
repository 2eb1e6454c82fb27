"""nanguard report --plot draws the run with its incidents; the exit code says whether the run ended unrecovered."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest

import lightning_nanguard as ng
from lightning_nanguard.cli import main
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, loggers, make_trainer


def test_plot_draws_the_curves_and_marks_each_incident(tmp_path: Any) -> None:
    callbacks = [
        FaultInjector("param", steps=[5]),
        ng.GradNormMonitor(),
        ng.AutoRollback(every_n_steps=2, quiet_steps=0),
    ]
    make_trainer(tmp_path, logger=loggers(tmp_path), max_steps=10, callbacks=callbacks).fit(TinyModel())
    run = os.path.join(tmp_path, "tb", "version_0")
    out = os.path.join(tmp_path, "run.svg")
    assert main(["report", run, "--plot", out]) == 0
    svg = pathlib.Path(out).read_text(encoding="utf-8")
    assert svg.startswith("<svg")
    assert 'data-tag="loss"' in svg
    assert 'data-tag="gradient norm"' in svg
    assert svg.count('class="incident"') == 1
    assert "step 5: corrupt_state -&gt; skip, rollback" in svg


def test_exit_code_3_when_the_run_ended_unrecovered(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(
        tmp_path,
        logger=loggers(tmp_path),
        max_steps=10,
        callbacks=[FaultInjector("grad", steps=[3]), ng.GradNormMonitor(on_nonfinite="stop")],
    )
    with pytest.raises(ng.NonFiniteTrainingError):
        trainer.fit(TinyModel())
    assert main(["report", os.path.join(tmp_path, "tb", "version_0")]) == 3
    assert "stop" in capsys.readouterr().out


def test_png_without_matplotlib_says_what_to_install(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    make_trainer(tmp_path, logger=loggers(tmp_path), max_steps=2, callbacks=[ng.GradNormMonitor()]).fit(TinyModel())
    assert main(["report", os.path.join(tmp_path, "tb", "version_0"), "--plot", str(tmp_path / "x.png")]) == 2
    assert "lightning-nanguard[plot]" in capsys.readouterr().err
