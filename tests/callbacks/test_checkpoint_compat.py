"""What CheckpointGuard (and the preset) must leave as Lightning has it: HPC resume, custom CheckpointIO plugins and
their ``storage_options``, remote log directories, logger calls, resumes from plain Lightning checkpoints, pickling.
Each of these was a difference in Lightning's own test suite run with the preset (``tools/lightning_suite``)."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import subprocess
import sys
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_nanguard import CheckpointGuard, GradNormMonitor, default_callbacks, verify_checkpoint
from lightning_nanguard.checkpointing.sidecar import LEGACY_SIDECAR_SUFFIX, SIDECAR_SUFFIX
from lightning_nanguard.checkpointing.verify import LAST_GOOD_NAME
from tests.helpers import TinyModel, make_trainer

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])

pytestmark = pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")


class Probe(Callback):
    def __init__(self) -> None:
        self.start_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step


def test_hpc_resume_finds_the_highest_version_beside_the_sidecars(tmp_path: pathlib.Path) -> None:
    # Lightning reads the digits of every file whose name holds "hpc_ckpt_" as a version: a sidecar named
    # hpc_ckpt_33.ckpt.sha256 read as version 33256, and the resume looked for a file that does not exist.
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], max_steps=2)
    trainer.fit(TinyModel())
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_3.ckpt")
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], max_steps=5)
    trainer.fit(TinyModel())
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_33.ckpt")
    assert (tmp_path / ("hpc_ckpt_33.ckpt" + SIDECAR_SUFFIX)).is_file()
    probe = Probe()
    with mock.patch("lightning.fabric.plugins.environments.slurm.SLURMEnvironment.detect", return_value=True):
        trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard(), probe], max_steps=6)
        trainer.fit(TinyModel())  # no ckpt_path: under SLURM, Lightning resumes from the highest hpc_ckpt_N
    assert probe.start_step == 5


class RecordingIO(TorchCheckpointIO):
    """A plugin that acts on the path and storage options it is given (as a cloud or sharded IO would)."""

    def __init__(self, write: bool = True) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.write = write

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.calls.append((path, storage_options))
        if self.write:
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            pathlib.Path(path).write_bytes(buf.getvalue())


def test_a_custom_checkpoint_io_gets_the_callers_path_and_storage_options(tmp_path: pathlib.Path) -> None:
    plugin = RecordingIO()
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], plugins=[plugin], max_steps=2)
    trainer.fit(TinyModel())
    target = tmp_path / "path.ckpt"
    trainer.save_checkpoint(target, storage_options={"acl": "private"})
    assert plugin.calls == [(target, {"acl": "private"})]  # the caller's own path object, not a temporary name
    assert verify_checkpoint(str(target)).ok  # hashed after the plugin wrote it, with its sidecar and the tag
    assert verify_checkpoint(str(tmp_path / LAST_GOOD_NAME)).ok
    trainer.save_checkpoint(target)  # saved again under the same name: the tag's content is never rewritten in place
    assert verify_checkpoint(str(tmp_path / LAST_GOOD_NAME)).ok


def test_an_io_that_writes_no_file_at_the_path_is_told_about_once_not_refused(tmp_path: pathlib.Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], plugins=[RecordingIO(write=False)], max_steps=2)
    trainer.fit(TinyModel())
    with pytest.warns(UserWarning, match="RecordingIO wrote no new file at this path: it has no sidecar"):
        trainer.save_checkpoint(tmp_path / "a.ckpt")
    trainer.save_checkpoint(tmp_path / "b.ckpt")  # once: no second warning
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_remote_log_dir_gets_no_local_folder_of_its_name(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = pl.Trainer(
        default_root_dir="memory://nanguard-compat",
        callbacks=default_callbacks(),
        max_steps=2,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="not a local file: written without a sidecar"):
        trainer.fit(TinyModel())
    assert list(tmp_path.iterdir()) == []  # no "memory:" folder with an incident log and a summary


class KeywordLogger(CSVLogger):
    def __init__(self, save_dir: str) -> None:
        super().__init__(save_dir)
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def log_metrics(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))
        super().log_metrics(*args, **kwargs)


def test_loggers_get_nanguards_metrics_by_keyword_as_lightning_calls_them(tmp_path: pathlib.Path) -> None:
    logger = KeywordLogger(str(tmp_path))
    make_trainer(tmp_path, callbacks=[GradNormMonitor()], logger=logger, max_steps=3).fit(TinyModel())
    ours = [kw for args, kw in logger.calls if any(k.startswith("nanguard/") for k in kw.get("metrics", {}))]
    assert ours
    assert all(not args for args, _ in logger.calls)


def test_the_preset_resumes_from_a_checkpoint_plain_lightning_wrote(tmp_path: pathlib.Path) -> None:
    trainer = make_trainer(tmp_path / "plain", max_steps=3)
    trainer.fit(TinyModel())
    plain = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(plain)  # no sidecar: checked by its zip CRC-32s, a weights-only load and finiteness
    probe = Probe()
    make_trainer(tmp_path, callbacks=[*default_callbacks(), probe], max_steps=5).fit(TinyModel(), ckpt_path=plain)
    assert probe.start_step == 3


def test_sidecars_of_earlier_versions_still_verify_and_a_new_save_replaces_them(tmp_path: pathlib.Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], max_steps=2)
    trainer.fit(TinyModel())
    path = tmp_path / "x.ckpt"
    trainer.save_checkpoint(path)
    legacy = pathlib.Path(str(path) + LEGACY_SIDECAR_SUFFIX)
    pathlib.Path(str(path) + SIDECAR_SUFFIX).rename(legacy)  # as an earlier version wrote it
    assert verify_checkpoint(str(path)).ok
    legacy.write_text("0" * 64 + "  x.ckpt\n")
    assert "sha256 does not match x.ckpt.sha256" in verify_checkpoint(str(path)).reason
    trainer.save_checkpoint(path)
    assert not legacy.exists()
    assert verify_checkpoint(str(path)).ok


def test_a_trainer_with_checkpoint_guard_still_pickles(tmp_path: pathlib.Path) -> None:
    trainer = make_trainer(tmp_path, callbacks=[CheckpointGuard()], max_steps=2)
    trainer.fit(TinyModel())
    pickle.dumps(trainer)  # the wrapper's hooks into the guard are bound methods, never closures


def test_importing_nanguard_leaves_lightnings_rank_zero_logger_where_it_was() -> None:
    # Importing the standalone lightning_fabric package re-points lightning_utilities' rank-zero logger to
    # "lightning_fabric...": Lightning's own log messages then miss a caplog set on "lightning.pytorch...".
    code = (
        "import sys, lightning.pytorch, lightning_nanguard, lightning_nanguard.forensics.op_stats\n"
        "from lightning_utilities.core import rank_zero\n"
        "assert 'lightning_fabric' not in sys.modules, 'lightning_fabric imported'\n"
        "assert rank_zero.log.name == 'lightning.pytorch.utilities.rank_zero', rank_zero.log.name\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": _ROOT})
