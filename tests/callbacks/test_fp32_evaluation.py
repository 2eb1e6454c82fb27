"""FP32Evaluation on real Trainer runs: the VMamba mechanism (evaluation overflows in half precision, training forces
float32 where it matters) under 16-mixed, bf16-mixed and 16-true/bf16-true."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping

from lightning_nanguard import FP32Evaluation, NanGuardConfigError
from lightning_nanguard.engine import get_engine
from tests.fp32_eval_models import HalfOverflowModel
from tests.helpers import make_trainer, params_of

HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16, "bf16-true": torch.bfloat16}


def _eval_trainer(tmp_path: Any, precision: str, callbacks: list[Any] | None = None, **kw: Any) -> Any:
    return make_trainer(tmp_path, precision, callbacks=callbacks or [], limit_val_batches=None, **kw)


def _fp32_reference(tmp_path: Any, model: HalfOverflowModel, stage: str = "validate") -> float:
    """The loss of a plain float32 evaluation of the same weights (after 16-true they are the half-rounded ones)."""
    ref = copy.deepcopy(model).float()
    trainer = _eval_trainer(tmp_path / "ref", "32-true")
    out = trainer.validate(ref, verbose=False) if stage == "validate" else trainer.test(ref, verbose=False)
    return float(out[0]["val_loss" if stage == "validate" else "test_loss"])


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_always_evaluates_in_fp32_where_half_precision_overflows(tmp_path: Any, precision: str) -> None:
    plain = HalfOverflowModel()
    out = _eval_trainer(tmp_path / "plain", precision).validate(plain, verbose=False)[0]
    assert not math.isfinite(out["val_loss"])  # the bug: evaluation overflows in the half dtype
    assert {dtype for _, dtype, _ in plain.eval_calls} == {HALF[precision]}

    model = HalfOverflowModel()
    out = _eval_trainer(tmp_path / "cb", precision, [FP32Evaluation("always")]).validate(model, verbose=False)[0]
    assert set(out) == {"val_loss"}  # "always" adds no metric of its own
    assert math.isfinite(out["val_loss"])
    assert out["val_loss"] == pytest.approx(_fp32_reference(tmp_path, model), rel=1e-6)
    assert {dtype for _, dtype, _ in model.eval_calls} == {torch.float32}  # outputs inside validation_step
    if precision.endswith("-true"):
        assert {p.dtype for p in model.parameters()} == {HALF[precision]}  # the real weights were never cast


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_test_stage_runs_in_fp32(tmp_path: Any, precision: str) -> None:
    model = HalfOverflowModel()
    out = _eval_trainer(tmp_path, precision, [FP32Evaluation("always")]).test(model, verbose=False)[0]
    assert out["test_loss"] == pytest.approx(_fp32_reference(tmp_path, model, "test"), rel=1e-6)
    assert {dtype for _, dtype, _ in model.eval_calls} == {torch.float32}


@pytest.mark.parametrize(
    ("precision", "mode"), [("16-mixed", "always"), ("16-true", "always"), ("16-true", "on_nonfinite")]
)
def test_training_trajectory_is_bit_identical(tmp_path: Any, precision: str, mode: str) -> None:
    def run(callbacks: list[Any], name: str) -> tuple[HalfOverflowModel, Any]:
        torch.manual_seed(0)
        model = HalfOverflowModel(bad_batches=(1,))
        trainer = make_trainer(
            tmp_path / name, precision, callbacks=callbacks, val_check_interval=2, limit_val_batches=2
        )
        trainer.fit(model)
        return model, trainer

    plain, plain_trainer = run([], "plain")
    guarded, trainer = run([FP32Evaluation(mode)], "guarded")
    assert not math.isfinite(float(plain_trainer.callback_metrics["val_loss"]))
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    assert guarded.train_losses == plain.train_losses
    for name, p in params_of(plain).items():
        assert torch.equal(p, params_of(guarded)[name]), name
    assert any(dtype == torch.float32 for _, dtype, _ in guarded.eval_calls)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_on_nonfinite_reruns_exactly_the_nonfinite_batches(tmp_path: Any, precision: str) -> None:
    model = HalfOverflowModel(bad_batches=(1, 3))
    callback = FP32Evaluation("on_nonfinite")
    trainer = _eval_trainer(tmp_path, precision, [callback])
    out = trainer.validate(model, verbose=False)[0]

    half = HALF[precision]
    assert [(i, dtype) for i, dtype, _ in model.eval_calls] == [
        (0, half),
        (1, half),
        (1, torch.float32),
        (2, half),
        (3, half),
        (3, torch.float32),
    ]
    assert callback.fp32_reruns == 2
    assert out["nanguard/eval/fp32_reruns"] == 2.0
    # The epoch value averages what each batch's kept call logged: the float32 re-run replaced the inf, not added to it.
    kept = model.last_eval_losses()
    assert all(math.isfinite(v) for v in kept.values())
    assert out["val_loss"] == pytest.approx(sum(kept.values()) / len(kept), rel=1e-6)

    # One incident for the epoch, with the count and the batches, not one per batch.
    (incident,) = get_engine(trainer).sink.records
    name = str(half).replace("torch.", "")
    assert incident.message == (
        f"2 validation batches (1, 3) overflowed in {name} and were re-run in float32, where they are finite: the "
        f"float32 results replace the {name} ones. If this happens every epoch, mode='always' saves the double work."
    )
    assert (incident.action, incident.trigger, str(incident.cause)) == (
        "rerun",
        "nonfinite_eval_output",
        "half_precision_overflow",
    )
    assert incident.values == {"stage": "validation", "count": 2, "eval_batches": [1, 3], "fp32_finite": True}
    assert incident.where == "2 validation batches: 1, 3"


def test_on_nonfinite_all_bad_equals_fp32_evaluation(tmp_path: Any) -> None:
    model = HalfOverflowModel(bad_batches=(0, 1, 2, 3))
    out = _eval_trainer(tmp_path, "16-true", [FP32Evaluation("on_nonfinite")]).validate(model, verbose=False)[0]
    assert out["val_loss"] == pytest.approx(_fp32_reference(tmp_path, model), rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-true"])
def test_on_nonfinite_costs_nothing_on_a_healthy_evaluation(tmp_path: Any, precision: str) -> None:
    model = HalfOverflowModel(bad_batches=())
    callback = FP32Evaluation("on_nonfinite")
    plain = copy.deepcopy(model)
    ref = _eval_trainer(tmp_path / "plain", precision).validate(plain, verbose=False)[0]
    out = _eval_trainer(tmp_path, precision, [callback]).validate(model, verbose=False)[0]
    assert callback.fp32_reruns == 0
    assert out["nanguard/eval/fp32_reruns"] == 0.0
    assert [(i, d) for i, d, _ in model.eval_calls] == [(i, HALF[precision]) for i in range(4)]  # no float32 call
    assert out["val_loss"] == ref["val_loss"]  # the logged values went through unchanged
    assert not os.path.exists(os.path.join(str(tmp_path), "nanguard", "incidents.jsonl"))


@pytest.mark.parametrize("mode", ["always", "on_nonfinite"])
def test_validate_then_fit_on_the_same_module(tmp_path: Any, mode: str) -> None:
    # trainer.validate runs under inference_mode: nothing the callback did may leave inference tensors behind.
    model = HalfOverflowModel()
    callback = FP32Evaluation(mode)
    trainer = make_trainer(tmp_path, "16-true", callbacks=[callback], val_check_interval=2, limit_val_batches=2)
    out = trainer.validate(model, verbose=False)[0]
    assert math.isfinite(out["val_loss"])
    before = params_of(model)
    trainer.fit(model)
    assert all(math.isfinite(v) for v in model.train_losses)
    assert any(not torch.equal(p, before[n]) for n, p in params_of(model).items())
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))


def test_nonfinite_validation_no_longer_stops_early_stopping(tmp_path: Any) -> None:
    def fit(callbacks: list[Any]) -> Any:
        trainer = make_trainer(tmp_path, "bf16-mixed", callbacks=callbacks, max_steps=16, limit_val_batches=2)
        trainer.fit(HalfOverflowModel())
        return trainer

    assert fit([EarlyStopping("val_loss", patience=5)]).global_step == 8  # stopped after the first (inf) validation
    assert fit([EarlyStopping("val_loss", patience=5), FP32Evaluation()]).global_step == 16


class _StepProbe(Callback):
    """Records the instance attribute ``validation_step`` at the start and end of validation."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(vars(pl_module).get("validation_step"))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.seen.append(vars(pl_module).get("validation_step"))


@pytest.mark.parametrize(("precision", "mode"), [("16-true", "always"), ("16-mixed", "on_nonfinite")])
def test_patches_restore_a_previous_instance_attribute(tmp_path: Any, precision: str, mode: str) -> None:
    # Lightning installs torch.compile-d steps as instance attributes: they must be re-assigned, not deleted.
    model = HalfOverflowModel()
    installed = model.validation_step
    model.validation_step = installed  # type: ignore[method-assign]
    trainer = _eval_trainer(tmp_path, precision, [FP32Evaluation(mode)])
    trainer.validate(model, verbose=False)
    assert vars(model)["validation_step"] is installed
    assert "log" not in vars(model)
    plugin = trainer.precision_plugin
    assert not {"convert_input", "val_step_context", "test_step_context"} & set(vars(plugin))


def test_compiled_module_stays_compiled(tmp_path: Any) -> None:
    model = HalfOverflowModel(bad_batches=(1,))
    compiled = torch.compile(model, backend="eager")
    probe = _StepProbe()
    trainer = _eval_trainer(tmp_path, "16-mixed", [probe, FP32Evaluation("on_nonfinite")])
    out = trainer.validate(compiled, verbose=False)[0]
    assert math.isfinite(out["val_loss"])
    compiled_step = probe.seen[0]
    assert compiled_step is not None  # Lightning's compiled wrapper
    assert vars(model)["validation_step"] is compiled_step


def test_warns_once_when_there_is_nothing_to_do(tmp_path: Any) -> None:
    callback = FP32Evaluation()
    trainer = make_trainer(tmp_path, "32-true", callbacks=[callback], limit_val_batches=2, max_steps=2)
    model = HalfOverflowModel(bad_batches=())

    def validate_then_fit() -> None:
        trainer.validate(model, verbose=False)
        trainer.fit(model)

    with pytest.warns(UserWarning, match="FP32Evaluation has nothing to do") as record:
        validate_then_fit()
    assert len([w for w in record if "nothing to do" in str(w.message)]) == 1


@pytest.mark.parametrize("mode", ["sometimes", None, 1])
def test_constructor_rejects_bad_mode(mode: Any) -> None:
    with pytest.raises(
        NanGuardConfigError, match=r"FP32Evaluation\(mode=.*\): must be one of \['always', 'on_nonfinite'\]"
    ):
        FP32Evaluation(mode=mode)


def test_state_round_trip(tmp_path: Any) -> None:
    callback = FP32Evaluation("on_nonfinite")
    _eval_trainer(tmp_path, "16-mixed", [callback]).validate(HalfOverflowModel(bad_batches=(2,)), verbose=False)
    assert callback.fp32_reruns == 1
    path = tmp_path / "state.pt"
    torch.save(callback.state_dict(), path)
    restored = FP32Evaluation("on_nonfinite")
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.fp32_reruns == 1
    assert restored.state_key == callback.state_key == FP32Evaluation("always").state_key == "FP32Evaluation"
    restored.load_state_dict({})  # tolerant of older/empty state
    assert restored.fp32_reruns == 0
