"""DeepSpeed: LossScaleWatchdog and GradNormMonitor read DeepSpeed's own step; the other callbacks refuse it.

Three layers: DeepSpeed's real scaler classes driven through nanguard's adapter (no Trainer); real ``Trainer.fit``
runs under DeepSpeedStrategy on this CPU (``_fit_worker.py``, one subprocess for all scenarios: DeepSpeed's import
costs seconds); the same fits on CUDA with the real, unpatched strategy (``gpu``, skipped without a CUDA device).
Everything skips when DeepSpeed is not installed (CI installs it: ``.ci/run``).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_nanguard import (
    AutoRollback,
    CheckpointGuard,
    FP32Evaluation,
    GradNormMonitor,
    LossScaleWatchdog,
    OptimizerBackoff,
)
from lightning_nanguard.callbacks._common import check_strategy_supported
from lightning_nanguard.callbacks._deepspeed import require_overflow_check
from lightning_nanguard.exceptions import NonFiniteTrainingError, UnsupportedSetupError
from lightning_nanguard.signals import deepspeed as ds_signals
from tests.sharded._launch import run_module

os.environ.setdefault("DS_ACCELERATOR", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # DeepSpeed's import trips torch.jit deprecations
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")

SCENARIOS = ["collapse_stops", "floor_above_deepspeed", "exit_explained", "fp16_skips_counted", "bf16_check_forced"]
HALLO = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


# ---------------------------------------------------------------------- which callback supports DeepSpeed
def _deepspeed_trainer() -> Any:
    return SimpleNamespace(strategy=type("DeepSpeedStrategy", (), {})())


@pytest.mark.parametrize("callback", [LossScaleWatchdog, GradNormMonitor], ids=lambda c: c.__name__)
def test_scale_and_norm_watchers_are_allowed(callback: type) -> None:
    check_strategy_supported(_deepspeed_trainer(), callback.__name__)


@pytest.mark.parametrize(
    ("callback", "reason"),
    [
        (AutoRollback, "fp32 master weights and the optimizer state inside its own"),
        (OptimizerBackoff, "no such remedy runs"),
        (FP32Evaluation, "converts the module to fp16/bf16 itself"),
        (CheckpointGuard, "its own checkpoint directory"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_the_rest_are_refused_each_with_its_reason(callback: type, reason: str) -> None:
    with pytest.raises(
        UnsupportedSetupError, match=rf"{callback.__name__} does not support DeepSpeedStrategy: .*{reason}"
    ):
        check_strategy_supported(_deepspeed_trainer(), callback.__name__)


def _trainer(precision: str, stage: int, bf16: dict[str, Any] | None = None) -> Any:
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if bf16 is not None:
        config["bf16"] = bf16
    return SimpleNamespace(precision=precision, strategy=SimpleNamespace(config=config))


def test_grad_norm_monitor_turns_on_deepspeeds_bf16_overflow_check_under_zero_1_and_2() -> None:
    for stage in (1, 2):
        trainer = _trainer("bf16-mixed", stage)
        assert require_overflow_check(trainer) is True
        assert trainer.strategy.config["bf16"] == {"enabled": True, "check_grad_overflow": True}
    kept = _trainer("bf16-true", 2, {"enabled": True, "check_grad_overflow": True})
    assert require_overflow_check(kept) is False  # the user's own setting: nothing to turn on
    assert require_overflow_check(_trainer("16-mixed", 3)) is False  # fp16 always checks


@pytest.mark.parametrize(
    ("precision", "stage", "bf16", "match"),
    [
        ("bf16-mixed", 3, None, "ZeRO stage 3"),
        ("bf16-mixed", 0, None, "ZeRO stage 0"),
        ("32-true", 2, None, "precision='32-true'"),
        ("bf16-mixed", 2, {"enabled": True, "check_grad_overflow": False}, 'check_grad_overflow": false'),
    ],
)
def test_grad_norm_monitor_refuses_where_deepspeed_cannot_see_a_nonfinite_step(
    precision: str, stage: int, bf16: dict[str, Any] | None, match: str
) -> None:
    with pytest.raises(UnsupportedSetupError, match=match):
        require_overflow_check(_trainer(precision, stage, bf16))


# ---------------------------------------------------------------------- DeepSpeed's own scaler classes
def _zero_scaler(**kwargs: Any) -> Any:
    args = {"init_scale": 8.0, "scale_window": 1000, "min_scale": 1.0, "delayed_shift": 1}
    return loss_scaler.DynamicLossScaler(**{**args, "consecutive_hysteresis": False, **kwargs})


def test_the_hallo_message_is_deepspeeds_own_exit() -> None:
    scaler = _zero_scaler(init_scale=1.0)
    with pytest.raises(Exception, match="Current loss scale already at minimum") as info:
        scaler.update_scale(True)
    assert str(info.value) == HALLO
    assert ds_signals.is_min_scale_exit(info.value)
    wrapped = RuntimeError("fit failed")
    wrapped.__cause__ = info.value
    assert ds_signals.is_min_scale_exit(wrapped)
    # nanguard's own stop quotes the message: that is not DeepSpeed's exit.
    assert not ds_signals.is_min_scale_exit(NonFiniteTrainingError(f"DeepSpeed would have said '{HALLO}'"))


def test_adapter_floors_zeros_scaler_and_takes_over_its_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_scaler, "dist", SimpleNamespace(get_rank=lambda: 0))  # its log line asks for the rank
    holder = _zero_scaler()
    scaler = ds_signals.find_scaler(SimpleNamespace(loss_scaler=holder))
    assert scaler is not None
    assert scaler.kind == "zero"
    assert (scaler.scale, scaler.min_scale, scaler.raises_at_min) == (8.0, 1.0, True)
    scaler.raises_at_min = False
    seen = []
    for _ in range(10):  # every step overflows: DeepSpeed halves, nanguard holds the floor after each step
        holder.update_scale(True)
        scaler.clamp(2.0, None)
        seen.append(scaler.scale)
    assert seen == [4.0, 2.0] + [2.0] * 8  # never below the floor, and DeepSpeed never raised
    holder.cur_scale = 1.0
    holder.update_scale(True)  # at DeepSpeed's own minimum: without the flag this raises (test above)
    assert holder.cur_scale == 1.0
    assert scaler.clamp(1.0, 0.5)
    assert scaler.scale == 0.5


def test_adapter_reads_the_fp16_optimizers_scale_config_and_skips_static_scalers() -> None:
    config = loss_scaler.LossScaleConfig(torch.float16, True, 0, None)
    scaler = ds_signals.find_scaler(SimpleNamespace(loss_scale_config=config))
    assert scaler is not None
    assert scaler.kind == "fp16_optimizer"
    assert (scaler.scale, scaler.min_scale, scaler.raises_at_min) == (2.0**32, 1.0, False)
    scaler.scale = 4.0
    assert config.cur_scale == 4.0
    # bf16/fp32 (ZeRO creates a static LossScaler of 1.0) and a static fp16 scale: nothing to watch.
    assert ds_signals.find_scaler(SimpleNamespace(loss_scaler=loss_scaler.LossScaler(1.0))) is None
    static = loss_scaler.LossScaleConfig(torch.float16, False, 128.0, None)
    assert ds_signals.find_scaler(SimpleNamespace(loss_scale_config=static)) is None
    assert ds_signals.find_scaler(SimpleNamespace()) is None


class _Engine:
    def __init__(self, overflow: bool, norm: Any, applied: bool) -> None:
        self.optimizer = SimpleNamespace(overflow=overflow)
        self._norm, self._applied = norm, applied
        self.global_steps, self.skipped_steps = 7, 2
        self.norm_reads = 0

    def get_global_grad_norm(self) -> Any:
        self.norm_reads += 1
        return self._norm

    def was_step_applied(self) -> bool:
        return self._applied


def test_step_outcome_never_reports_deepspeeds_stale_norm_of_a_skipped_step() -> None:
    # On an overflow DeepSpeed returns before computing a norm: its cached value is the previous step's.
    engine = _Engine(overflow=True, norm=torch.tensor(2.5), applied=False)
    outcome = ds_signals.read_step(engine)
    assert outcome.overflow
    assert not outcome.applied
    assert outcome.grad_norm == math.inf
    assert not outcome.norm_known
    assert engine.norm_reads == 0
    applied = ds_signals.read_step(_Engine(overflow=False, norm=torch.tensor(2.5), applied=True))
    assert (applied.grad_norm, applied.norm_known, applied.step, applied.skipped_total) == (2.5, True, 7, 2)
    missing = ds_signals.read_step(_Engine(overflow=False, norm=None, applied=True))
    assert math.isnan(missing.grad_norm)
    assert not missing.norm_known


# ---------------------------------------------------------------------- real fits
def _fits(tmp_path_factory: pytest.TempPathFactory, gpu: bool) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("deepspeed") / "fits.json")
    run_module("tests.deepspeed._fit_worker", [out, *(["--gpu"] if gpu else []), *SCENARIOS], timeout=240)
    with open(out, encoding="utf-8") as f:
        results: dict[str, Any] = json.load(f)
    for name, result in results.items():
        assert "crash" not in result, f"{name}:\n{result['crash']}"
    return results


@pytest.fixture(scope="module")
def cpu_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _fits(tmp_path_factory, gpu=False)


@pytest.fixture(scope="module")
def gpu_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _fits(tmp_path_factory, gpu=True)


def check_collapse_stops(run: dict[str, Any]) -> None:
    """fp16, every step overflows, nanguard floor = DeepSpeed's min_loss_scale = 1: nanguard ends it, not DeepSpeed."""
    assert run["error"].startswith("NonFiniteTrainingError: nanguard: DeepSpeed's fp16 loss scale collapsed")
    assert HALLO in run["error"]
    assert "lower learning rate" in run["error"]
    assert [(i["trigger"], i["action"]) for i in run["incidents"]] == [("loss_scale_collapse", "stop")]
    assert run["incidents"][0]["values"]["floor_hits"] == 3
    assert run["loss_scale"]
    assert min(run["loss_scale"]) == 1.0
    assert run["overflow_steps"][-1] == run["ds_skipped_steps"]  # every overflow is DeepSpeed's own skip
    assert run["raise_error_at_min_scale"] is True  # DeepSpeed's exit is given back after the fit
    assert run["params_finite"]


def _every(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each occurrence of each incident record (a recurring incident is one record with ``repeats``)."""
    return [i for i in incidents for _ in range(1 + int(i.get("repeats", 0)))]


def check_floor_above_deepspeed(run: dict[str, Any]) -> None:
    """min_scale=2 above DeepSpeed's 1: the scale never goes below 2; on_collapse='warn' keeps training."""
    assert run["error"] == ""
    assert set(run["loss_scale"]) == {2.0}
    assert [i["action"] for i in _every(run["incidents"])] == ["warn", "warn"]
    assert "Kept training (on_collapse='warn')" in run["incidents"][0]["message"]


def check_exit_explained(run: dict[str, Any]) -> None:
    """Both collapse rules off: DeepSpeed keeps its exit, and the watchdog explains it."""
    assert run["error"] == f"Exception: {HALLO}"
    assert [(i["trigger"], i["action"]) for i in run["incidents"]] == [("loss_scale_collapse", "stop")]
    message = run["incidents"][0]["message"]
    assert "DeepSpeed stopped the run" in message
    assert "min_loss_scale" in message
    assert "hysteresis" in message


def check_fp16_skips_counted(run: dict[str, Any]) -> None:
    """fp16 from scale 2**18: the first steps overflow and DeepSpeed drops them; nanguard counts them truly."""
    skipped = [not a for a in run["ds_applied"]]
    assert any(skipped)
    assert not all(skipped)
    assert [i["action"] for i in _every(run["incidents"])] == ["scaler_skip"] * sum(skipped)
    assert run["skipped_steps"][-1] == run["ds_skipped_steps"] == sum(skipped)
    applied_norms = [n for n, a in zip(run["ds_norms"], run["ds_applied"], strict=True) if a]
    assert run["grad_norm"] == pytest.approx(applied_norms)  # the engine's global norm, applied steps only
    # One logging step per step: an overflow step's max is inf, never DeepSpeed's stale cached norm.
    expected = [math.inf if skip else n for skip, n in zip(skipped, run["ds_norms"], strict=True)]
    assert run["grad_norm_max"] == pytest.approx(expected)


def check_bf16_check_forced(run: dict[str, Any]) -> None:
    """bf16 ZeRO-2, a NaN loss at step 3: DeepSpeed drops it only because the monitor turned its check on."""
    assert run["error"] == ""
    assert run["ds_applied"] == [True, True, True, False, True, True]
    assert [(i["step"], i["action"]) for i in run["incidents"]] == [(3, "scaler_skip")]
    assert "check_grad_overflow" in run["incidents"][0]["message"]
    assert run["params_finite"]


CHECKS = {name: globals()[f"check_{name}"] for name in SCENARIOS}


@pytest.mark.distributed
def test_two_ranks_take_deepspeeds_reduced_decision_alike(tmp_path: Any) -> None:
    """2 CPU ranks, fp16, only rank 1's loss overflows: DeepSpeed all-reduces its overflow flag, so both ranks see
    every overflow, floor alike, and stop at the same step with the same incidents (no collective of nanguard's)."""
    out = str(tmp_path / "fits.json")
    run_module("tests.deepspeed._fit_worker", [out, "two_ranks"], timeout=240)
    ranks = []
    for path in (out, f"{out}.rank1"):
        with open(path, encoding="utf-8") as f:
            run = json.load(f)["two_ranks"]
        assert "crash" not in run, run.get("crash")
        ranks.append(run)
    assert [r["rank"] for r in ranks] == [0, 1]
    events = [[(i["step"], i["trigger"], i["action"], i["ranks"]) for i in r["incidents"]] for r in ranks]
    assert events[0] == events[1]
    assert ("loss_scale_collapse", "stop") in [(t, a) for _, t, a, _ in events[0]]
    assert all(i[3] == [] for i in events[0])  # which rank overflowed is not known after DeepSpeed's reduction
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"].startswith("NonFiniteTrainingError: nanguard: DeepSpeed's fp16 loss scale collapsed")
    assert ranks[0]["ds_applied"] == ranks[1]["ds_applied"] == [False] * len(ranks[0]["ds_applied"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_deepspeed_fit_on_cpu(cpu_fits: dict[str, Any], scenario: str) -> None:
    CHECKS[scenario](cpu_fits[scenario])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_deepspeed_fit_on_gpu(gpu_fits: dict[str, Any], scenario: str) -> None:
    CHECKS[scenario](gpu_fits[scenario])
