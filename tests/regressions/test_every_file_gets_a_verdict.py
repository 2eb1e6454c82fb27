"""Every file nanguard reads gets a verdict whatever its bytes: a clear message, never a traceback (issue 40).

One real run (the preset, a NaN record, a logger, ModelCheckpoint) writes a file of each kind: checkpoints with their
sidecars and the last-good tag, the quarantine list, the incident log, the summary, an incident bundle. Each reader
is then fed what a crash, a bad disk or a careless edit leaves of its file (``tests/fuzz.py``: cut short, flipped,
noise, another encoding, nesting made to exhaust a recursive reader, each key of the wrong JSON type) and random
bytes or JSON from hypothesis: it returns its verdict or raises its documented error, nothing else. ``nanguard
verify`` prints a FAIL line for a damaged file and still checks the others; a callback's malformed saved state is a
``CheckpointVerificationError``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import CheckpointVerificationError, NanGuardConfigError, NanGuardWarning, default_callbacks
from lightning_nanguard.checkpointing.fallback import fallback_bound, recorded_step
from lightning_nanguard.checkpointing.lineage import lineage_of
from lightning_nanguard.checkpointing.manifest import MANIFEST_FORMAT, MANIFEST_NAME, verify_directory
from lightning_nanguard.checkpointing.orphans import remove_orphans
from lightning_nanguard.checkpointing.sidecar import meta_of
from lightning_nanguard.checkpointing.verify import (
    LAST_GOOD_NAME,
    SIDECAR_SUFFIX,
    VerifyResult,
    last_good_checkpoint,
    verify_checkpoint,
)
from lightning_nanguard.cli import main
from lightning_nanguard.commands.ablate import _final_weights
from lightning_nanguard.exceptions import BundleError
from lightning_nanguard.forensics.bundle_read import Bundle, read_bundle
from lightning_nanguard.preset import CALLBACKS
from lightning_nanguard.recovery.quarantine import Quarantine
from lightning_nanguard.recovery.quarantine_file import QuarantineRecord, read_file
from lightning_nanguard.reporting.incidents import IncidentLog
from lightning_nanguard.reporting.plot import read_series
from lightning_nanguard.reporting.summary import format_summary
from tests.fuzz import FUZZ, damaged_bytes, deep_checkpoint, deep_list, json_values, verdict, wrong_types
from tests.helpers import make_trainer


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x).squeeze(1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One preset run that wrote a file of every kind nanguard reads; their paths by kind."""
    root = tmp_path_factory.mktemp("run")
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    x[5, 0] = float("nan")  # one bad record: an incident, its bundle, a quarantine
    ckpts = root / "ckpts"
    saver = ModelCheckpoint(dirpath=str(ckpts), every_n_train_steps=2, save_top_k=-1)
    callbacks = [*default_callbacks(), saver]
    trainer = make_trainer(root, max_steps=4, callbacks=callbacks, logger=True, enable_checkpointing=True)
    trainer.fit(Tiny(), DataLoader(TensorDataset(x, torch.zeros(32)), batch_size=8))
    log = root / "lightning_logs" / "version_0" / "nanguard"
    files = {
        "checkpoint": str(next(p for p in sorted(ckpts.iterdir()) if p.name.endswith("step=4.ckpt"))),
        "tag": str(ckpts / LAST_GOOD_NAME),
        "quarantine": str(log / "quarantine.json"),
        "incidents": str(log / "incidents.jsonl"),
        "summary": str(log / "summary.txt"),
        "bundle": str(next((log / "bundles").iterdir())),
        "ckpts": str(ckpts),
    }
    for kind, path in files.items():
        assert os.path.exists(path), f"the run wrote no {kind}: {path}"
    assert os.path.exists(files["checkpoint"] + SIDECAR_SUFFIX)
    return files


def _copy_dir(source: str, target: Path) -> str:
    shutil.copytree(source, target)
    return str(target)


def _write(path: str | Path, data: bytes | str | Any) -> None:
    if isinstance(data, str):
        data = data.encode()
    elif not isinstance(data, bytes):
        data = json.dumps(data).encode()
    Path(path).write_bytes(data)


def _checked(result: VerifyResult) -> None:
    assert isinstance(result, VerifyResult)
    assert result.ok or result.reason.strip()


# ---------------------------------------------------------------- checkpoints, sidecars, the last-good tag
def _verify_all(directory: str, path: str) -> None:
    """Every reader of a checkpoint directory gives its verdict on it."""
    for require in (True, False):
        _checked(verify_checkpoint(path, require_sidecar=require))
        last = last_good_checkpoint(directory, require_sidecar=require)
        assert last is None or os.path.isfile(last)
    assert isinstance(meta_of(path), dict)
    lineage_of(meta_of(path))
    fallback_bound(path)
    recorded_step(path)
    remove_orphans(directory)


@pytest.mark.parametrize("case", sorted(damaged_bytes(b"0123456789" * 50)))
@pytest.mark.parametrize("kind", ["checkpoint", "tag", "sidecar", "tag sidecar"])
def test_a_damaged_checkpoint_sidecar_or_tag_gets_a_verdict(
    run: dict[str, str], tmp_path: Path, kind: str, case: str
) -> None:
    directory = _copy_dir(run["ckpts"], tmp_path / "ckpts")
    name = os.path.basename(run["tag" if kind.startswith("tag") else "checkpoint"])
    target = os.path.join(directory, name + (SIDECAR_SUFFIX if kind.endswith("sidecar") else ""))
    with open(target, "rb") as f:
        valid = f.read()
    _write(target, damaged_bytes(valid).get(case, b""))
    _verify_all(directory, target.removesuffix(SIDECAR_SUFFIX))


@FUZZ
@given(data=st.binary(max_size=2048), cut=st.integers(min_value=0, max_value=10_000))
def test_random_or_cut_checkpoint_bytes_get_a_verdict(
    run: dict[str, str], tmp_path: Path, data: bytes, cut: int
) -> None:
    with open(run["checkpoint"], "rb") as f:
        valid = f.read()
    for content in (data, valid[:cut] + data):
        path = tmp_path / "fuzzed.ckpt"
        _write(path, content)
        _checked(verify_checkpoint(str(path)))
        _checked(verify_checkpoint(str(path), require_sidecar=False))


@pytest.mark.parametrize(
    "content",
    [
        deep_checkpoint(),
        deep_checkpoint(key="state_dict"),
        deep_checkpoint(key="optimizer_states"),
        {"state_dict": [1, 2]},
        {"state_dict": {"w": "x"}, "global_step": "4"},
        {"state_dict": {}, "optimizer_states": {"a": deep_list(200)}},
        [torch.ones(2)] * 3,
        "a string",
    ],
    ids=["deep", "deep state_dict", "deep optimizer", "state_dict a list", "wrong types", "nested", "list", "str"],
)
def test_a_checkpoint_of_the_wrong_shape_gets_a_verdict(tmp_path: Path, content: Any) -> None:
    path = tmp_path / "odd.ckpt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    _checked(verify_checkpoint(str(path), require_sidecar=False))
    _checked(verify_checkpoint(str(path)))


@FUZZ
@given(meta=json_values())
def test_any_sidecar_record_gets_a_verdict(run: dict[str, str], tmp_path: Path, meta: Any) -> None:
    directory = str(tmp_path / "ckpts")
    shutil.rmtree(directory, ignore_errors=True)
    _copy_dir(run["ckpts"], Path(directory))
    for name in (os.path.basename(run["checkpoint"]), LAST_GOOD_NAME):
        sidecar = os.path.join(directory, name + SIDECAR_SUFFIX)
        with open(sidecar, encoding="utf-8") as f:
            digest_line = f.read().splitlines()[0]
        _write(sidecar, f"{digest_line}\n# nanguard: {json.dumps(meta)}\n")
        _verify_all(directory, os.path.join(directory, name))


def test_verify_prints_a_fail_line_for_a_damaged_file_and_checks_the_others(
    run: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _copy_dir(run["ckpts"], tmp_path / "ckpts")
    bad = os.path.join(directory, os.path.basename(run["checkpoint"]))
    _write(bad, "[" * 100_000)
    _write(os.path.join(directory, LAST_GOOD_NAME + SIDECAR_SUFFIX), b"\xff\xfe garbage")
    files = sorted(p for p in os.listdir(directory) if p.endswith(".ckpt"))
    assert main(["verify", directory]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "Traceback" not in "\n".join(out)
    assert any(line.startswith(f"FAIL {bad}: ") for line in out)
    assert any(line.startswith("FAIL ") and LAST_GOOD_NAME in line for line in out)
    assert sum(line.startswith("OK   ") for line in out) == len(files) - 2  # the others still checked
    assert out[-1] == f"{len(files) - 2} of {len(files)} checkpoints verify"


# ---------------------------------------------------------------- a distributed checkpoint's manifest
@pytest.mark.parametrize(
    "content",
    [
        *damaged_bytes(json.dumps({"format": MANIFEST_FORMAT, "finite": True, "files": {"a.distcp": {}}}).encode()),
        *(
            f"json: {k}"
            for k in wrong_types(
                {"format": MANIFEST_FORMAT, "finite": True, "files": {"a.distcp": {"size": 3, "sha256": "ab"}}}
            )
        ),
        "json: a listed file outside the directory",
    ],
)
def test_a_damaged_distributed_manifest_gets_a_verdict(tmp_path: Path, content: str) -> None:
    valid = {"format": MANIFEST_FORMAT, "finite": True, "files": {"a.distcp": {"size": 3, "sha256": "ab"}}}
    directory = tmp_path / "dcp"
    directory.mkdir()
    _write(directory / "a.distcp", b"abc")
    (tmp_path / "secret").write_bytes(b"abc")
    if content == "json: a listed file outside the directory":
        data: Any = {**valid, "files": {"../secret": {"size": 3, "sha256": "ab"}}}
    elif content.startswith("json: "):
        data = wrong_types(valid)[content.removeprefix("json: ")]
    else:
        data = damaged_bytes(json.dumps(valid).encode())[content]
    _write(directory / MANIFEST_NAME, data)
    reason = verify_directory(str(directory))
    assert reason is not None
    assert reason.strip()


# ---------------------------------------------------------------- the quarantine list
def _quarantine_verdicts(path: str, content: Any) -> None:
    _write(path, content)
    verdict(lambda: read_file(path), NanGuardConfigError)
    try:
        data = json.loads(content) if isinstance(content, (bytes, str)) else content
    except (ValueError, RecursionError):
        return
    verdict(lambda: Quarantine(None).load_state_dict(data), CheckpointVerificationError)


@pytest.mark.parametrize("case", ["bytes", "json"])
def test_a_damaged_quarantine_list_gets_a_verdict(run: dict[str, str], tmp_path: Path, case: str) -> None:
    with open(run["quarantine"], "rb") as f:
        valid = f.read()
    contents = damaged_bytes(valid) if case == "bytes" else wrong_types(json.loads(valid))
    for content in contents.values():
        _quarantine_verdicts(str(tmp_path / "quarantine.json"), content)
    assert isinstance(read_file(run["quarantine"]), QuarantineRecord)


@FUZZ
@given(value=json_values() | st.binary(max_size=512))
def test_any_quarantine_list_gets_a_verdict(tmp_path: Path, value: Any) -> None:
    _quarantine_verdicts(str(tmp_path / "q.json"), value)


# ---------------------------------------------------------------- the incident log and the summary
def _report_verdicts(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    records, notes = IncidentLog.read_checked(path)
    format_summary(records, ["GradNormMonitor"], path)
    assert all(n.strip() for n in notes)
    capsys.readouterr()
    assert main(["report", os.path.dirname(os.path.dirname(path))]) in (0, 2, 3)
    assert "Traceback" not in "".join(capsys.readouterr())


@pytest.mark.parametrize("case", ["bytes", "json"])
def test_a_damaged_incident_log_gets_a_verdict(
    run: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    with open(run["incidents"], "rb") as f:
        valid = f.read()
    first = json.loads(valid.splitlines()[0])
    contents: dict[str, Any] = damaged_bytes(valid) if case == "bytes" else wrong_types(first)
    contents.update({f"repeat line {k}": v for k, v in wrong_types({"repeat_of": 0, "step": 1}).items()})
    log = tmp_path / "nanguard"
    log.mkdir()
    for content in contents.values():
        text = content if isinstance(content, bytes) else (valid + json.dumps(content).encode() + b"\n")
        _write(log / "incidents.jsonl", text)
        _report_verdicts(str(log / "incidents.jsonl"), capsys)


@FUZZ
@given(lines=st.lists(json_values() | st.binary(max_size=64), max_size=4))
def test_any_incident_log_gets_a_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[Any]) -> None:
    log = tmp_path / "fuzz" / "nanguard"
    log.mkdir(parents=True, exist_ok=True)
    encoded = [v if isinstance(v, bytes) else json.dumps(v).encode() for v in lines]
    _write(log / "incidents.jsonl", b"\n".join(encoded))
    _report_verdicts(str(log / "incidents.jsonl"), capsys)


@pytest.mark.parametrize("case", sorted(damaged_bytes(b"nanguard summary\nno incidents\n")))
def test_a_damaged_summary_file_gets_a_verdict(
    run: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    with open(run["summary"], "rb") as f:
        valid = f.read()
    log = tmp_path / "nanguard"
    log.mkdir()
    _write(log / "summary.txt", damaged_bytes(valid).get(case, b""))
    assert main(["report", str(tmp_path)]) in (0, 3)
    assert "Traceback" not in "".join(capsys.readouterr())


# ---------------------------------------------------------------- incident bundles
def _bundle_verdict(path: str) -> None:
    found = verdict(lambda: read_bundle(path), BundleError)
    assert isinstance(found, (Bundle, str))


@pytest.mark.parametrize("name", ["manifest.json", "step.pt"])
def test_a_damaged_bundle_file_gets_a_verdict(run: dict[str, str], tmp_path: Path, name: str) -> None:
    path = _copy_dir(run["bundle"], tmp_path / "bundle")
    with open(os.path.join(path, name), "rb") as f:
        valid = f.read()
    contents: dict[str, Any] = damaged_bytes(valid)
    if name == "manifest.json":
        contents.update(wrong_types(json.loads(valid)))
    else:  # past the sha256 the manifest records too (a bundle of an older nanguard records none)
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        _write(os.path.join(path, "manifest.json"), {k: v for k, v in manifest.items() if k != "files"})
    for content in contents.values():
        _write(os.path.join(path, name), content)
        _bundle_verdict(path)


@FUZZ
@given(
    key=st.sampled_from(["module", "qualname", "hparams", "origin", "diagnosis", "step", "state"]), value=json_values()
)
def test_any_manifest_value_gets_a_verdict(run: dict[str, str], tmp_path: Path, key: str, value: Any) -> None:
    path = str(tmp_path / "bundle")
    shutil.rmtree(path, ignore_errors=True)
    _copy_dir(run["bundle"], Path(path))
    with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    _write(os.path.join(path, "manifest.json"), {**manifest, key: value})
    _bundle_verdict(path)


# ---------------------------------------------------------------- a callback's saved state inside a checkpoint
@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_a_callbacks_malformed_saved_state_is_a_verification_error(cls: type[pl.Callback]) -> None:
    valid = cls().state_dict()
    cases = {**wrong_types(valid), "deep": deep_list(), "deep value": {k: deep_list() for k in valid}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NanGuardWarning)  # a state this callback cannot hold is reported, not loaded
        for state in cases.values():
            verdict(lambda state=state: cls().load_state_dict(state), CheckpointVerificationError)


@FUZZ
@given(cls=st.sampled_from(CALLBACKS), key=st.text(max_size=20), value=json_values())
def test_any_saved_state_value_gets_a_verdict(cls: type[pl.Callback], key: str, value: Any) -> None:
    valid = cls().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NanGuardWarning)
        for k in [*valid, key]:
            verdict(lambda k=k: cls().load_state_dict({**valid, k: value}), CheckpointVerificationError)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # the run's ModelCheckpoint is not here
def test_a_resume_from_a_checkpoint_with_malformed_callback_state_stops_with_a_verification_error(
    run: dict[str, str], tmp_path: Path
) -> None:
    ckpt = torch.load(run["checkpoint"], weights_only=True)
    ckpt["callbacks"]["GradNormMonitor"]["skipped_steps"] = {"not": "a count"}
    ckpt["callbacks"]["AutoRollback"] = "garbage"
    path = str(tmp_path / "edited.ckpt")
    torch.save(ckpt, path)
    x = torch.randn(32, 4)
    trainer = make_trainer(tmp_path, max_steps=6, callbacks=default_callbacks(CheckpointGuard=False))
    with pytest.raises(CheckpointVerificationError, match=r"(GradNormMonitor|AutoRollback): the checkpoint's saved"):
        trainer.fit(Tiny(), DataLoader(TensorDataset(x, torch.zeros(32)), batch_size=8), ckpt_path=path)


@pytest.mark.parametrize("name", ["metrics.csv", "events.out.tfevents.1.host"])
def test_damaged_metrics_get_a_verdict_in_the_plot_and_the_ablation(tmp_path: Path, name: str) -> None:
    """``nanguard report --plot`` reads the logger's metrics; ``nanguard ablate`` a run's summary.txt."""
    valid = b"step,train_loss,nanguard/grad_norm\n0,0.5,1.0\n1,0.4,0.9\n"
    for i, content in enumerate([*damaged_bytes(valid).values(), b"step,train_loss\nx,y\n,\n1\n", b"a\0b,c\n1,2\n"]):
        run_dir = tmp_path / str(i)
        run_dir.mkdir()
        _write(run_dir / name, content)
        _write(run_dir / "summary.txt", content)
        found = verdict(lambda run_dir=run_dir: read_series(str(run_dir)), RuntimeError)
        assert isinstance(found, (dict, str))
        finite, note = _final_weights(str(run_dir), 0.1)
        assert isinstance(finite, bool)
        assert isinstance(note, str)
