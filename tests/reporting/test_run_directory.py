"""Where ``incidents.jsonl`` and ``summary.txt`` go: the first logger's run folder, never the working directory.

A logger that keeps its history in memory (scvi-tools' ``SimpleLogger``) reports the working directory as its
``save_dir``; ``trainer.log_dir`` is then the working directory and nanguard wrote ``./nanguard/`` into it (issue 30).
The folder is now where Lightning puts that logger's checkpoints, less ``checkpoints``: ``<save_dir>/<name>/<version>``,
with the Trainer's ``default_root_dir`` in place of a ``save_dir`` that is the working directory; no files for a logger
that saves nothing locally.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment

from lightning_nanguard import default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer


class InMemoryLogger(Logger):
    """Keeps its history in memory and reports ``save_dir`` (the working directory by default), as scvi's does."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__()
        self.history: list[dict[str, float]] = []
        self._save_dir = os.getcwd() if save_dir is None else save_dir

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 3

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        return self.history

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append(dict(metrics))


def _files(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _fit(tmp_path: pathlib.Path, logger: Any) -> str | None:
    trainer = make_trainer(
        tmp_path / "root", logger=logger, callbacks=[*default_callbacks(), FaultInjector("loss", steps=[2])]
    )
    trainer.fit(TinyModel())
    return get_engine(trainer).sink.log_dir


def test_an_in_memory_logger_in_the_working_directory_writes_nothing_there(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    log_dir = _fit(tmp_path, InMemoryLogger())
    assert _files(cwd) == []
    assert log_dir == str(tmp_path / "root" / "memory" / "version_3")  # default_root_dir/<name>/<version>
    assert {"incidents.jsonl", "summary.txt"} <= set(os.listdir(os.path.join(log_dir, "nanguard")))


def test_a_logger_with_a_save_dir_of_its_own_gets_its_run_folder(tmp_path: pathlib.Path) -> None:
    log_dir = _fit(tmp_path, InMemoryLogger(str(tmp_path / "logs")))
    assert log_dir == str(tmp_path / "logs" / "memory" / "version_3")  # as Lightning places its checkpoints
    files = _files(tmp_path / "logs")
    assert {"memory/version_3/nanguard/incidents.jsonl", "memory/version_3/nanguard/summary.txt"} <= set(files)
    assert all(f.startswith("memory/version_3/nanguard/") for f in files)  # the bundle of the incident too


def test_tensorboard_keeps_its_log_dir(tmp_path: pathlib.Path) -> None:
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="run", version=0)
    assert _fit(tmp_path, logger) == logger.log_dir


def test_fast_dev_run_and_a_logger_that_saves_nothing_locally_get_no_files(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's own suite found it: fast_dev_run's DummyLogger (save_dir None) must not send files to the cwd.
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer(tmp_path, logger=True, fast_dev_run=1, callbacks=default_callbacks())
    trainer.fit(TinyModel())
    assert get_engine(trainer).sink.log_dir is None
    assert _files(tmp_path) == []
