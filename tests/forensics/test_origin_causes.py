"""The cause decided from the origin, on real fits with the whole preset: each pattern's origin (the op and the line
of the test model that made it), its cause, and its remedy. None of these patterns damages the state, so none gets a
rollback or a learning-rate cut; the records that trigger a formula bug are quarantined as its trigger."""

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
from lightning.pytorch.loggers import CSVLogger

from lightning_nanguard import default_callbacks
from lightning_nanguard.engine import get_engine
from lightning_nanguard.forensics.bundle import read_bundle
from lightning_nanguard.reporting.incidents import Incident
from tests.forensics import origin_models as m

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 3  # the bad batch comes back every epoch: a quarantined trigger must not


def _fit(tmp_path: Path, model: pl.LightningModule, precision: str = "32-true", **monitor: Any) -> list[Incident]:
    callbacks = default_callbacks(GradNormMonitor={"max_replay_steps": 1e9, **monitor})
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        precision=precision,  # type: ignore[arg-type]
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    return [r for r in get_engine(trainer).sink.records if r.step >= 0 and r.trigger != "preflight_note"]


def _step_incidents(records: list[Incident]) -> list[Incident]:
    """The training-step incidents (not a preflight finding at step 0)."""
    return [r for r in records if str(r.trigger).startswith("nonfinite")]


# (id, model, precision, marker, op, phase, cause)
CASES: list[tuple[str, Callable[[], pl.LightningModule], str, str, str, str, str]] = [
    ("norm_without_eps", m.NormNoEps, "32-true", "norm", "aten.div.Tensor", "forward", "division_by_zero"),
    (
        "where_masked_branch",
        m.MaskedEntropy,
        "32-true",
        "where",
        "aten.log.default",
        "forward",
        "masked_branch_gradient",
    ),
    (
        "fully_masked_row",
        lambda: m.MaskedAttention(fully_masked=True),
        "32-true",
        "softmax",
        "aten._softmax.default",
        "forward",
        "fully_masked_softmax",
    ),
    ("bce_on_sigmoid_bf16", m.SigmoidBCE, "bf16-mixed", "bce", "aten.log.default", "forward", "low_precision_rounding"),
    ("exp_overflow_fp16", m.HandSoftmax, "16-true", "exp", "aten.exp.default", "forward", "exp_overflow"),
    ("sqrt_at_zero", m.PairDistance, "32-true", "sqrt", "aten.div.Tensor", "backward", "sqrt_at_zero"),
]


@pytest.mark.parametrize(
    ("make", "precision", "marker", "op", "phase", "cause"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_formula_bug_is_named_by_its_op_and_line_and_its_trigger_quarantined(
    tmp_path: Path, make: Callable[[], pl.LightningModule], precision: str, marker: str, op: str, phase: str, cause: str
) -> None:
    [incident] = _step_incidents(_fit(tmp_path, make(), precision))  # once: its trigger does not come back
    d = incident.diagnosis
    origin: Any = d["origin"]
    assert (incident.cause, origin["op"], origin["phase"]) == (cause, op, phase)
    assert (origin["frame"]["file"], origin["frame"]["line"]) == (m.__file__, m.marker_line(marker))
    assert f"{m.__file__}:{m.marker_line(marker)}" in incident.where
    assert d["rows"] == [m.BAD_ROW]
    assert not origin["data_at_fault"]
    assert d["caused_by_data"]  # the trigger, quarantined as such: the formula is at fault
    assert "the data is valid" in d["note"]
    assert [str(a) for a in incident.actions] == ["skip", "quarantine"]  # no rollback, no LR cut
    assert "as the trigger of a formula bug" in incident.message
    assert not d["state_damaged"]
    assert os.path.isdir(incident.bundle)


def test_the_norm_without_eps_names_the_division_and_its_line_and_replay_agrees(tmp_path: Path) -> None:
    """The issue's first case: no explosion, no rollback, no LR cut; the all-zero record is quarantined (it met the
    formula once, not every epoch); the incident names the division and its line, and ``nanguard replay`` on its
    bundle names the same op, line and cause."""
    [incident] = _step_incidents(_fit(tmp_path, m.NormNoEps()))
    line = m.marker_line("norm")
    assert incident.where == f"aten.div.Tensor (forward) at {m.__file__}:{line} in training_step, batch 2 rows [1]"
    evidence = incident.diagnosis["evidence"]
    assert [e["kind"] for e in evidence] == ["origin", "counterfactual"]  # no rising history; the blame tested
    assert evidence[0]["stats"]["denominator_producer"] == "aten.linalg_vector_norm.default"
    assert "eps" in str(incident.diagnosis["hint"])
    assert incident.to_dict()["bundle"] == incident.bundle
    bundle = read_bundle(incident.bundle)
    assert bundle.manifest["step"] == incident.step
    assert bundle.manifest["diagnosis"]["cause"] == "division_by_zero"
    with open(os.path.join(tmp_path, "csv", "version_0", "nanguard", "incidents.jsonl"), encoding="utf-8") as f:
        [record] = [json.loads(x) for x in f]
    assert record["bundle"] == incident.bundle

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_nanguard.cli", "replay", incident.bundle],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"origin: aten.div.Tensor (forward) at {m.__file__}:{line} in training_step" in proc.stdout
    assert "cause: division_by_zero (as the incident named)" in proc.stdout


def test_a_nan_record_is_the_data_named_by_its_field_and_row(tmp_path: Path) -> None:
    [incident] = _step_incidents(_fit(tmp_path, m.NaNRecord()))
    d = incident.diagnosis
    assert incident.cause == "input_data"
    assert (d["origin"]["phase"], d["origin"]["fields"], d["origin"]["rows"]) == ("input", ("[0]",), (m.BAD_ROW,))
    assert d["origin"]["data_at_fault"]
    assert (d["origin"]["frame"]["line"], d["origin"]["module"]) == (m.marker_line("input"), "body.0")
    assert d["rows"] == [m.BAD_ROW]
    [origin] = [e for e in d["evidence"] if e["kind"] == "origin"]
    assert f"field [0] (batch rows [1]), first used by aten.addmm.default at {m.__file__}:" in origin["summary"]
    assert [str(a) for a in incident.actions] == ["skip", "quarantine"]


def test_an_additive_minus_inf_mask_in_the_batch_is_no_incident(tmp_path: Path) -> None:
    assert _fit(tmp_path, m.MaskedAttention()) == []


def test_an_unrelated_fault_beside_a_minus_inf_mask_does_not_blame_the_mask(tmp_path: Path) -> None:
    [incident] = _step_incidents(_fit(tmp_path, m.MaskedAttention(nan_record=True)))
    d = incident.diagnosis
    assert incident.cause == "input_data"
    assert d["origin"]["fields"] == ("['x']",)
    assert d["rows"] == [m.BAD_ROW]  # not every row, as the mask's -inf in every row would have it
    assert incident.where == f"batch {m.BAD_BATCH} rows [{m.BAD_ROW}]"
    assert [e["kind"] for e in d["evidence"]] == ["batch_nonfinite", "origin", "counterfactual"]
    assert "field ['x']" in d["evidence"][1]["summary"]
    assert "mask" not in incident.message
    assert [str(a) for a in incident.actions] == ["skip", "quarantine"]


def test_no_bundle_when_off_or_over_budget(tmp_path: Path) -> None:
    [none] = _step_incidents(_fit(tmp_path / "zero", m.NormNoEps(), bundle_mb=0.0))
    assert none.bundle == ""
    [tiny] = _step_incidents(_fit(tmp_path / "tiny", m.NormNoEps(), bundle_mb=1e-6))
    assert tiny.bundle == ""
    assert not (tmp_path / "tiny" / "csv" / "version_0" / "nanguard" / "bundles").exists()
    off = _step_incidents(_fit(tmp_path / "off", m.NormNoEps(), forensics="off"))
    assert {(r.bundle, r.cause) for r in off} == {("", "unknown")}  # no replay, no origin: cheap evidence only


def test_a_bundle_that_fails_to_write_leaves_training_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_nanguard.engine.diagnose as diagnose

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no room on this device")

    monkeypatch.setattr(diagnose, "write_bundle", fail)
    [incident] = _step_incidents(_fit(tmp_path, m.NormNoEps()))
    assert (incident.cause, incident.bundle) == ("division_by_zero", "")
