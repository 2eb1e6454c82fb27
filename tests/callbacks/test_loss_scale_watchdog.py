"""LossScaleWatchdog on real Trainer.fit runs under 16-mixed (the CPU GradScaler) with deterministic faults."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_nanguard import (
    AutoRollback,
    GradNormMonitor,
    LossScaleWatchdog,
    NanGuardConfigError,
    NonFiniteTrainingError,
    RecoveryBudgetExhausted,
    _notices,
)
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, csv_metrics, make_trainer, params_of

OVERFLOW = list(range(2, 60))  # steps 0 and 1 are healthy, then every step overflows


def amp(init_scale: float = 1024.0, **scaler_kw: Any) -> dict[str, Any]:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, **scaler_kw)
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}


class ScaleProbe(Callback):
    """The GradScaler's real scale after every batch (installed after the watchdog, so after its clamp)."""

    def __init__(self) -> None:
        self.after: list[tuple[int, float]] = []
        self.first: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append((trainer.global_step, trainer.precision_plugin.scaler.get_scale()))


def _trainer(tmp_path: Any, callbacks: list[Callback], init_scale: float = 1024.0, **kw: Any) -> pl.Trainer:
    return make_trainer(tmp_path, "16-mixed", callbacks=callbacks, **{**amp(init_scale), **kw})


@pytest.mark.parametrize("target", ["grad", "loss"])
def test_forced_overflow_stops_at_the_floor_and_explains(tmp_path: Any, target: str) -> None:
    probe = ScaleProbe()
    watchdog = LossScaleWatchdog(min_scale=64.0, floor_patience=3, max_overflow_streak=None, on_collapse="stop")
    trainer = _trainer(tmp_path, [FaultInjector(target, steps=OVERFLOW, value="inf"), watchdog, probe], max_steps=30)
    with pytest.raises(NonFiniteTrainingError, match=r"global_step=8") as err:
        trainer.fit(TinyModel())
    # 1024 -> 64 in four overflows (steps 2-5); steps 6, 7, 8 overflow at the floor: the third is the collapse.
    assert probe.after == [(1, 1024.0), (2, 1024.0), (3, 512.0), (4, 256.0), (5, 128.0), (6, 64.0), (7, 64.0),
                           (8, 64.0), (9, 64.0)]  # fmt: skip
    assert trainer.global_step == 9  # stopped after the collapse step
    text = str(err.value)
    assert "3 overflowing steps with the scale already at its floor min_scale=64" in text
    assert "Cause: gradient explosion" in text
    assert "lower the learning rate" in text
    assert "State now: parameters and buffers are finite (checked)" in text
    collapse = get_engine(trainer).sink.records[-1]
    assert (collapse.step, collapse.action, collapse.trigger) == (8, "stop", "loss_scale_collapse")
    assert collapse.actions == ["scaler_skip", "stop"]
    assert collapse.cause == "gradient_explosion"
    assert collapse.values["scale_history"] == [[0, 1024.0], [3, 512.0], [4, 256.0], [5, 128.0], [6, 64.0]]


def test_without_the_watchdog_the_scale_falls_below_any_floor(tmp_path: Any) -> None:
    # The control for the test above: the same run, no watchdog, no floor.
    probe = ScaleProbe()
    _trainer(tmp_path, [FaultInjector("grad", steps=OVERFLOW, value="inf"), probe], max_steps=9).fit(TinyModel())
    assert probe.after[-1] == (9, 1024.0 / 2**7)


def test_scale_never_reaches_zero(tmp_path: Any) -> None:
    # Start near float32's smallest subnormal so that a few overflows are enough: GradScaler alone reaches 0.0.
    init, floor = 2.0**-145, 2.0**-147
    bare, guarded = ScaleProbe(), ScaleProbe()
    _trainer(tmp_path / "bare", [FaultInjector("grad", steps=range(8), value="inf"), bare], init, max_steps=8).fit(
        TinyModel()
    )
    assert bare.after[-1][1] == 0.0
    watchdog = LossScaleWatchdog(min_scale=floor, floor_patience=None, max_overflow_streak=None)
    trainer = _trainer(
        tmp_path / "guarded", [FaultInjector("grad", steps=range(8), value="inf"), watchdog, guarded], init, max_steps=8
    )
    trainer.fit(TinyModel())
    assert [s for _, s in guarded.after] == [2.0**-146, floor, floor, floor, floor, floor, floor, floor]
    assert watchdog.state_dict()["overflow_steps"] == 8
    # Both collapse rules off: the floor alone. Each overflow is the scaler's routine skip, never a collapse.
    assert {tuple(r.actions) for r in get_engine(trainer).sink.records} == {("scaler_skip",)}


def test_streak_rule_warns_within_budget_then_stops(tmp_path: Any) -> None:
    watchdog = LossScaleWatchdog(
        min_scale=1e-3, floor_patience=None, max_overflow_streak=4, on_collapse="warn", max_collapses=1
    )
    trainer = _trainer(tmp_path, [FaultInjector("grad", steps=range(50), value="inf"), watchdog], max_steps=30)
    with (
        pytest.warns(UserWarning, match=r"global_step=3.*4 overflowing steps in a row.*on_collapse='warn'"),
        pytest.raises(RecoveryBudgetExhausted, match=r"global_step=7.*collapse budget.*max_collapses"),
    ):
        trainer.fit(TinyModel())
    collapses = [r for r in get_engine(trainer).sink.records if r.trigger == "loss_scale_collapse"]
    assert [(r.step, r.actions) for r in collapses] == [(3, ["scaler_skip", "warn"]), (7, ["scaler_skip", "stop"])]


def test_healthy_run_grows_per_schedule_and_is_bit_identical(tmp_path: Any) -> None:
    def run(sub: str, callbacks: list[Callback]) -> tuple[TinyModel, pl.Trainer]:
        model = TinyModel()
        logger = CSVLogger(str(tmp_path / sub), name="csv", version=0)
        trainer = make_trainer(tmp_path / sub, "16-mixed", callbacks=callbacks, logger=logger, **amp(growth_interval=2))
        trainer.fit(model)
        return model, trainer

    plain, _ = run("plain", [])
    pl.seed_everything(1234, verbose=False)
    watched, trainer = run("watched", [LossScaleWatchdog()])
    a, b = params_of(plain), params_of(watched)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert trainer.precision_plugin.scaler.get_scale() == 8192.0
    rows = [r for r in csv_metrics(str(tmp_path / "watched" / "csv" / "version_0")) if r.get("nanguard/loss_scale")]
    assert [float(r["nanguard/loss_scale"]) for r in rows] == [1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 8192.0]
    assert {float(r["nanguard/overflow_steps"]) for r in rows} == {0.0}
    assert {float(r["nanguard/overflow_rate"]) for r in rows} == {0.0}
    assert {float(r["nanguard/overflow_streak"]) for r in rows} == {0.0}
    assert len(get_engine(trainer).sink.records) == 0


def test_max_scale_caps_growth_and_overflow_keys_are_logged(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    callbacks = [FaultInjector("grad", steps=[3, 4], value="inf"), LossScaleWatchdog(max_scale=2048.0, window=4)]
    make_trainer(tmp_path, "16-mixed", callbacks=callbacks, logger=logger, **amp(growth_interval=1)).fit(TinyModel())
    rows = [r for r in csv_metrics(str(tmp_path / "csv" / "version_0")) if r.get("nanguard/loss_scale")]
    got = [(float(r["nanguard/loss_scale"]), float(r["nanguard/overflow_streak"])) for r in rows]
    assert got == [(2048.0, 0), (2048.0, 0), (2048.0, 0), (1024.0, 1), (512.0, 2), (1024.0, 0)]
    assert [float(r["nanguard/overflow_steps"]) for r in rows] == [0, 0, 0, 1, 2, 2]
    assert [float(r["nanguard/overflow_rate"]) for r in rows] == [0, 0, 0, 0.25, 0.5, 0.5]


def test_initial_scale_is_raised_to_the_floor_before_the_lazy_init(tmp_path: Any) -> None:
    probe = ScaleProbe()
    trainer = _trainer(tmp_path, [LossScaleWatchdog(min_scale=64.0), probe], init_scale=8.0, max_steps=2)
    assert trainer.precision_plugin.scaler._scale is None  # GradScaler creates its scale tensor on the first step
    trainer.fit(TinyModel())
    assert probe.first == 64.0


def test_gradient_accumulation_and_fused_optimizer(tmp_path: Any) -> None:
    probe = ScaleProbe()
    watchdog = LossScaleWatchdog(min_scale=256.0, floor_patience=2, max_overflow_streak=None)
    trainer = _trainer(
        tmp_path,
        [FaultInjector("loss", steps=range(1, 20), value="inf"), watchdog, probe],
        max_steps=10,
        accumulate_grad_batches=2,
    )
    with pytest.raises(NonFiniteTrainingError, match=r"global_step=4.*floor min_scale=256"):
        trainer.fit(TinyModel(optimizer="adamw", fused=True))
    # One scaler.update() per optimizer step, not per micro-batch: 1024 -> 512 -> 256 (steps 1, 2), then the floor.
    assert [s for step, s in probe.after[1::2]] == [1024.0, 512.0, 256.0, 256.0, 256.0]


def _nan_checkpoint(tmp_path: Any) -> str:
    """Fit 3 healthy steps, save, then write NaN into the saved weights (as a corrupted file would hold)."""
    trainer = _trainer(tmp_path / "good", [], max_steps=3)
    trainer.fit(TinyModel(n=24))  # 3 batches: the checkpoint is at an epoch end, resumable without a warning
    path = str(tmp_path / "poisoned.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["state_dict"]["head.weight"][0, 0] = math.nan
    torch.save(checkpoint, path)
    return path


def test_resume_from_nan_checkpoint_names_the_checkpoint(tmp_path: Any) -> None:
    path = _nan_checkpoint(tmp_path)
    watchdog = LossScaleWatchdog(min_scale=1.0, max_overflow_streak=3, on_collapse="stop")
    trainer = _trainer(tmp_path / "resumed", [watchdog], max_steps=20)
    with pytest.raises(NonFiniteTrainingError) as err:
        trainer.fit(TinyModel(n=24), ckpt_path=path)
    text = str(err.value)
    # The first bad step after the resume finds the weights non-finite: no need to wait for a collapse.
    assert "global_step=3" in text
    assert f"head.weight (loaded from {path})" in text
    assert "resume from an earlier one" in text
    assert "lower the learning rate" not in text
    [incident] = get_engine(trainer).sink.records
    assert incident.cause == "corrupt_state"
    assert incident.diagnosis["state_tensors"] == ["head.weight"]


def test_state_round_trips_through_weights_only_checkpoint(tmp_path: Any) -> None:
    def watchdog() -> LossScaleWatchdog:
        return LossScaleWatchdog(min_scale=128.0, floor_patience=2, max_overflow_streak=None, on_collapse="warn")

    first = watchdog()
    trainer = _trainer(tmp_path, [FaultInjector("grad", steps=range(1, 6), value="inf"), first], max_steps=6)
    with pytest.warns(UserWarning, match=r"loss-scale collapse.*global_step=5.*2 more collapses allowed"):
        trainer.fit(TinyModel(n=48))  # 6 batches: the checkpoint below is at an epoch end
    path = str(tmp_path / "state.ckpt")
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["callbacks"][first.state_key]
    assert state["overflow_steps"] == 5
    assert state["collapses"] == 1
    assert state["recent"] == [0, 1, 1, 1, 1, 1]
    assert state["history"] == [[0, 1024.0], [2, 512.0], [3, 256.0], [4, 128.0]]
    fresh = watchdog()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == first.state_dict()
    fresh.load_state_dict({})  # tolerant of older/empty state
    assert fresh.state_dict()["overflow_steps"] == 0

    # Resuming carries the counters on: two more overflows at the floor make the second collapse.
    resumed = watchdog()
    trainer = _trainer(tmp_path / "r", [FaultInjector("grad", steps=[6, 7], value="inf"), resumed], max_steps=9)
    with pytest.warns(UserWarning, match=r"global_step=7.*1 more collapses allowed"):
        trainer.fit(TinyModel(n=48), ckpt_path=path)
    assert resumed.state_dict()["overflow_steps"] == 7
    assert resumed.state_dict()["collapses"] == 2


def test_a_collapse_is_rolled_back_by_autorollback(tmp_path: Any) -> None:
    rollback = AutoRollback(every_n_steps=1, quiet_steps=0)
    watchdog = LossScaleWatchdog(min_scale=1.0, max_overflow_streak=3, on_collapse="rollback", max_collapses=None)
    faults = FaultInjector("grad", steps=range(2, 8), value="inf")
    trainer = _trainer(tmp_path, [watchdog, faults, rollback], max_steps=10)
    trainer.fit(TinyModel())
    collapses = [r for r in get_engine(trainer).sink.records if r.trigger == "loss_scale_collapse"]
    # Streaks 2-4 and 5-7: the restore resets the watchdog's count.
    assert [(r.step, r.actions) for r in collapses] == [
        (4, ["scaler_skip", "rollback"]),
        (7, ["scaler_skip", "rollback"]),
    ]
    assert rollback.rollbacks == 2


def test_rollback_without_autorollback_says_so_at_setup_and_stops(tmp_path: Any) -> None:
    watchdog = LossScaleWatchdog(max_overflow_streak=2, on_collapse="rollback")
    trainer = _trainer(tmp_path, [FaultInjector("grad", steps=range(10), value="inf"), watchdog])
    with (
        pytest.warns(UserWarning, match=r"on_collapse='rollback'\) hands a collapse to AutoRollback, which is not"),
        pytest.raises(NonFiniteTrainingError, match=r"global_step=1.*no AutoRollback is installed"),
    ):
        trainer.fit(TinyModel())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_without_a_grad_scaler_it_says_so_once_and_does_nothing(
    tmp_path: Any, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Asserts what is said, not how logging propagates (which differs across pytest versions).
    said: list[str] = []
    monkeypatch.setattr(_notices, "note", lambda message, *a, **k: said.append(str(message)))
    watchdog = LossScaleWatchdog()
    trainer = make_trainer(tmp_path, precision, max_steps=3, callbacks=[watchdog])
    trainer.fit(TinyModel())
    said = [m for m in said if "LossScaleWatchdog does nothing" in m]
    assert len(said) == 1
    assert f"precision {precision!r} uses no GradScaler" in said[0]
    assert not any(k.startswith("nanguard/") for k in trainer.callback_metrics)
    assert watchdog.state_dict()["recent"] == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_scale": 0.0}, r"LossScaleWatchdog\(min_scale=0.0\): must be a number in \(0.0"),
        ({"min_scale": -1.0}, r"min_scale=-1.0\): must be a number in \(0.0"),
        ({"min_scale": math.inf}, r"min_scale=inf\): must be a number"),
        ({"min_scale": math.nan}, r"min_scale=nan\): must be a number"),
        ({"max_scale": 0.5}, r"max_scale=0.5, min_scale=1.0\): .*max_scale must be >= min_scale, or None"),
        ({"floor_patience": 0}, r"floor_patience=0\): must be an int or None >= 1"),
        ({"max_overflow_streak": 1.5}, r"max_overflow_streak=1.5\): must be an int or None >= 1"),
        ({"on_collapse": "rollbak"}, r"on_collapse='rollbak'\): must be one of \['auto', 'rollback', 'stop', 'warn'\]"),
        ({"max_collapses": -1}, r"max_collapses=-1\): must be an int or None >= 0"),
        ({"window": 0}, r"window=0\): must be an int >= 1"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(NanGuardConfigError, match=match):
        LossScaleWatchdog(**kwargs)


def test_incidents_reach_the_jsonl_log(tmp_path: Any) -> None:
    watchdog = LossScaleWatchdog(max_overflow_streak=2, on_collapse="stop")
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = _trainer(tmp_path, [FaultInjector("grad", steps=[0, 1], value="nan"), watchdog], logger=logger)
    with pytest.raises(NonFiniteTrainingError):
        trainer.fit(TinyModel())
    with open(os.path.join(logger.log_dir, "nanguard", "incidents.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [(r["step"], r["trigger"], r["actions"]) for r in lines] == [
        (0, "nonfinite_grads", ["scaler_skip"]),
        (1, "loss_scale_collapse", ["scaler_skip", "stop"]),
    ]


@pytest.mark.parametrize("watchdog_first", [True, False])
def test_composes_with_grad_norm_monitor_in_any_order(tmp_path: Any, watchdog_first: bool) -> None:
    probe = ScaleProbe()
    watchdog = LossScaleWatchdog(min_scale=256.0, floor_patience=2, max_overflow_streak=None, on_collapse="stop")
    monitor = GradNormMonitor(max_consecutive_skips=50)
    pair: list[Callback] = [watchdog, monitor] if watchdog_first else [monitor, watchdog]
    trainer = _trainer(tmp_path, [FaultInjector("grad", steps=range(1, 20), value="inf"), *pair, probe], max_steps=20)
    with pytest.raises(NonFiniteTrainingError, match=r"loss-scale collapse.*global_step=4"):
        trainer.fit(TinyModel())
    assert [s for _, s in probe.after] == [1024.0, 512.0, 256.0, 256.0, 256.0]
    records = get_engine(trainer).sink.records
    # One incident per event: routine overflows are the scaler's; the collapse carries both of its actions.
    assert [(r.step, r.actions) for r in records] == [
        (1, ["scaler_skip"]),
        (2, ["scaler_skip"]),
        (3, ["scaler_skip"]),
        (4, ["scaler_skip", "stop"]),
    ]
    assert monitor.skipped_steps == 4  # the collapse step is counted once, whoever drops it


class ManualModel(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def test_manual_optimization_keeps_the_floor(tmp_path: Any) -> None:
    probe = ScaleProbe()
    watchdog = LossScaleWatchdog(min_scale=256.0, floor_patience=2, max_overflow_streak=None)
    trainer = _trainer(tmp_path, [FaultInjector("grad", steps=range(1, 20), value="inf"), watchdog, probe], max_steps=9)
    with pytest.raises(NonFiniteTrainingError, match=r"global_step=4.*floor min_scale=256"):
        trainer.fit(ManualModel())
    assert [s for _, s in probe.after] == [1024.0, 512.0, 256.0, 256.0, 256.0]


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("ran_with", "clamped"),
    [(2.0**16, False), (96.0, True), (2.0**20, True), (None, True)],  # floor 64: 96 * 0.5 < 64; cap 2**20
)
def test_the_floor_costs_no_device_op_where_the_update_cannot_leave_the_range(
    ran_with: float | None, clamped: bool
) -> None:
    from types import SimpleNamespace

    from lightning_nanguard.engine.reading import Reading

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))
    reading = Reading(0, 0, 0, 1.0, 1.0, ran_with, True, None, None)  # type: ignore[arg-type]
    watchdog = LossScaleWatchdog(min_scale=64.0, max_scale=2.0**20)
    with _OpCounter() as counter:
        watchdog.after_step(trainer, [reading])  # type: ignore[arg-type]
    assert bool(counter.ops) == clamped, counter.ops
