"""An incident bundle written from a real fit, read back, and replayed offline by ``nanguard replay``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard.cli import main
from lightning_nanguard.forensics.bundle import BUNDLES_DIR, BundleError, BundleWritten, read_bundle, write_bundle
from tests.forensics import origin_models as m

ROOT = Path(__file__).resolve().parents[2]


class BundleAt(m.TraceAt):
    """Traces the bad batch and writes its bundle, as the engine's incident path will."""

    def __init__(self, log_dir: str, budget_mb: float = 64.0) -> None:
        super().__init__(m.BAD_BATCH)
        self.log_dir, self.budget_mb = log_dir, budget_mb
        self.written: BundleWritten | None = None

    def on_traced(self, trainer: pl.Trainer, pl_module: pl.LightningModule, idx: int) -> None:
        traced = self.traced[idx]
        self.written = write_bundle(self.log_dir, trainer, pl_module, self.batch, idx, traced, budget_mb=self.budget_mb)


def _bundle(tmp_path: Path, make: Callable[[], Any], precision: str = "32-true", **kw: Any) -> BundleAt:
    callback = BundleAt(str(tmp_path), **kw)
    m.fit(make(), callback, precision, root=str(tmp_path))
    return callback


def _replay(path: str, *extra: str, capsys: Any) -> tuple[int, str, str]:
    """``nanguard replay`` in this process (the subprocess test below runs the real command once)."""
    code = main(["replay", path, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _run_replay(path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_nanguard.cli", "replay", path, *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_replay_of_a_norm_without_eps_names_the_same_op_and_line(tmp_path: Path) -> None:
    """The issue's "Must show": the bundle of a normalisation without eps meeting an all-zero record, replayed
    offline, names the division and the line of that expression, as the traced incident did."""
    callback = _bundle(tmp_path, m.NormNoEps)
    written = callback.written
    assert written is not None
    assert written.path is not None, written.reason
    assert written.path == os.path.join(str(tmp_path), BUNDLES_DIR, f"step-{m.BAD_BATCH}")
    assert written.state == "full"
    traced = callback.traced[m.BAD_BATCH].origin
    assert traced is not None
    assert traced.frame is not None
    assert (traced.op, traced.frame.line) == ("aten.div.Tensor", m.marker_line("norm"))

    proc = _run_replay(written.path)
    assert proc.returncode == 0, proc.stderr
    line = f"origin: aten.div.Tensor (forward) at {m.__file__}:{m.marker_line('norm')} in training_step"
    assert line in proc.stdout, proc.stdout
    assert "verdict: division_by_zero" in proc.stdout
    assert "data at fault: yes" in proc.stdout  # the record triggers it, as the online incident says (quarantined)


def test_replay_says_whether_float32_fixes_it(tmp_path: Path, capsys: Any) -> None:
    written = _bundle(tmp_path, m.SigmoidBCE, "bf16-mixed").written
    assert written is not None
    assert written.path is not None
    code, stdout, err = _replay(written.path, "--json", capsys=capsys)
    assert code == 0, err
    out = json.loads(stdout)
    assert [(r["precision"], r["reproduced"]) for r in out["runs"]] == [("bf16-mixed", True), ("32-true", False)]
    origin = out["runs"][0]["origin"]
    assert (origin["op"], origin["frame"]["line"]) == ("aten.log.default", m.marker_line("bce"))
    assert out["float32_fixes"] is True
    assert out["verdict"]["kind"] == "low_precision_rounding"


def test_a_bundle_reads_back_weights_only(tmp_path: Path) -> None:
    callback = _bundle(tmp_path, lambda: m.MaskedAttention(fully_masked=True))
    written = callback.written
    assert written is not None
    assert written.path is not None
    bundle = read_bundle(written.path)
    assert bundle.manifest["module"] == "tests.forensics.origin_models"
    assert bundle.manifest["qualname"] == "MaskedAttention"
    assert bundle.manifest["hparams"] == {"fully_masked": True, "nan_record": False}
    assert bundle.manifest["optimizers"][0]["class"] == "torch.optim.sgd:SGD"
    assert bundle.manifest["optimizers"][0]["param_groups"][0]["lr"] == 0.01
    assert set(bundle.batch) == {"x", "mask", "y"}
    assert torch.equal(bundle.batch["mask"], callback.batch["mask"])
    assert set(bundle.state) == {"qkv.weight", "qkv.bias", "head.weight", "head.bias"}
    assert bundle.origin == callback.traced[m.BAD_BATCH].origin
    assert bundle.manifest["verdict"]["kind"] == "fully_masked_softmax"
    assert bundle.call is not None
    assert bundle.call[0] == "aten._softmax.default"


def test_over_the_budget_only_the_origin_module_and_op_are_kept(tmp_path: Path, capsys: Any) -> None:
    """A state past the budget keeps the origin module's tensors and the origin op's inputs; replay re-runs the op."""
    written = _bundle(tmp_path, m.SquareFeatures, "16-true", budget_mb=450 / 2**20).written
    assert written is not None
    assert written.path is not None, written.reason
    assert written.state == "origin_module"
    assert "the state outside square" in written.reason
    bundle = read_bundle(written.path)
    assert set(bundle.state) == {"square.scale"}
    assert bundle.state["square.scale"].dtype == torch.float16
    code, out, err = _replay(written.path, capsys=capsys)
    assert code == 0, err
    assert "replay of the origin op aten.mul.Tensor alone in 16-true on cpu: non-finite" in out
    assert "replay of the origin op aten.mul.Tensor alone in 32-true on cpu: finite" in out
    assert "float32 fixes it: yes" in out


def test_no_bundle_past_the_budget(tmp_path: Path) -> None:
    written = _bundle(tmp_path, m.NormNoEps, budget_mb=1e-6).written
    assert written is not None
    assert written.path is None
    assert "over budget_mb" in written.reason
    assert not os.listdir(os.path.join(str(tmp_path), BUNDLES_DIR)) if os.path.isdir(tmp_path / BUNDLES_DIR) else True


def test_replay_usage_errors_exit_2(tmp_path: Path, capsys: Any) -> None:
    code, _, err = _replay(str(tmp_path / "nowhere"), capsys=capsys)
    assert code == 2
    assert "no bundle at" in err
    with pytest.raises(BundleError, match="no bundle"):
        read_bundle(str(tmp_path))


def _edit_manifest(path: str, **changes: Any) -> None:
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest.update(changes)
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def test_replay_says_how_to_make_the_module_importable_and_buildable(tmp_path: Path, capsys: Any) -> None:
    written = _bundle(tmp_path, m.NormNoEps).written
    assert written is not None
    assert written.path is not None
    _edit_manifest(written.path, module="no_such_package.models")
    code, _, err = _replay(written.path, capsys=capsys)
    assert code == 2
    assert "cannot import no_such_package.models:NormNoEps" in err
    assert "from the directory that holds the package" in err

    _edit_manifest(written.path, module="tests.forensics.origin_models", hparams={"width": 3})
    code, _, err = _replay(written.path, capsys=capsys)
    assert code == 2
    assert "cannot build NormNoEps(**{'width': 3})" in err
    assert "save_hyperparameters()" in err

    _edit_manifest(written.path, module="__main__", hparams={})
    code, _, err = _replay(written.path, capsys=capsys)
    assert code == 2
    assert "cannot be imported by name" in err
    assert "--module" in err
