"""OptimizerBackoff on real Trainer runs: TRELLIS eps underflow, schedules keeping the backoff, resume, rollback."""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.optim import lr_scheduler as S

from lightning_nanguard import (
    GradNormMonitor,
    NanGuardConfigError,
    NonFiniteTrainingError,
    OptimizerBackoff,
    UnsupportedSetupError,
)
from lightning_nanguard.contract import RestoreSource, StateRestored
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, csv_metrics, make_trainer

SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda s: min(1.0, (s + 1) / 5)),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=40),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4, eta_min=1e-3),
}


class SchedModel(TinyModel):
    """TinyModel with a step-interval scheduler (n=48: 6 batches per epoch, so 6 steps end an epoch)."""

    def __init__(self, sched: str = "LambdaLR", groups_eps: tuple[float, ...] | None = None, **kw: Any) -> None:
        super().__init__(n=48, **kw)
        self.sched, self.groups_eps = sched, groups_eps

    def configure_optimizers(self) -> Any:
        if self.groups_eps is not None:
            groups = [{"params": self.body.parameters(), "eps": self.groups_eps[0]}]
            groups.append({"params": self.head.parameters(), "eps": self.groups_eps[1]})
            opt = torch.optim.AdamW(groups, lr=self.lr)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, **self.opt_kw)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": SCHEDULERS[self.sched](opt), "interval": "step"}}


class Recorder(Callback):
    """The lr each optimizer step uses (at batch start) and the eps its optimizer reads (just before the step)."""

    def __init__(self) -> None:
        self.lr: dict[int, float] = {}
        self.eps: dict[int, float] = {}
        self.trainer: pl.Trainer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.trainer = trainer

    def incidents(self, action: str = "backoff") -> list[Any]:
        assert self.trainer is not None
        return [i for i in get_engine(self.trainer).sink.records if i.action == action]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lr[trainer.global_step] = float(trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.eps[trainer.global_step] = float(optimizer.param_groups[0]["eps"])


def incidents_at(steps: list[int], value: float = 1e6) -> list[Callback]:
    """A real event at each of ``steps`` (>= 1: the first step teaches the spike detector) whose remedy is a lower
    learning rate: a gradient-norm spike (one gradient ``value`` times too large) that GradNormMonitor drops. (A
    non-finite gradient injected at a step does not reproduce in the replay: ``transient``, never met with a lower
    learning rate.)

    With ``backoff()`` (one such skip is enough) each event lowers the learning rate once.
    """
    return [FaultInjector("grad", steps=steps, value=value), GradNormMonitor(**SPIKE_SKIPS)]


# A spike is 40 standard deviations of the log gradient norm: a 1e6 jump is, the first steps' moves are not.
SPIKE_SKIPS: dict[str, Any] = {"spike_zscore": 40.0, "spike_warmup": 1, "on_spike": "skip"}


def backoff(**kw: Any) -> OptimizerBackoff:
    return OptimizerBackoff(skips_before_backoff=1, **kw)


class RollbackSim(Callback):
    """Snapshot optimizer+scheduler at one step, restore deep copies later and emit "restored", as AutoRollback does."""

    def __init__(self, snap_at: int, restore_after: int, emits: int = 2) -> None:
        self.snap_at, self.restore_after, self.emits = snap_at, restore_after, emits
        self.snapshot: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.snap_at:
            sched = trainer.lr_scheduler_configs[0].scheduler
            self.snapshot = copy.deepcopy((trainer.optimizers[0].state_dict(), sched.state_dict()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step - 1 == self.restore_after:
            opt_state, sched_state = copy.deepcopy(self.snapshot)
            trainer.optimizers[0].load_state_dict(opt_state)
            trainer.lr_scheduler_configs[0].scheduler.load_state_dict(sched_state)
            for _ in range(self.emits):  # a second emit must not apply the factor twice
                get_engine(trainer).bus.emit(trainer, StateRestored(self.snap_at, RestoreSource.MEMORY))


def _fit(tmp_path: Any, callbacks: list[Callback], sched: str = "LambdaLR", steps: int = 12, **kw: Any) -> Recorder:
    rec = Recorder()
    model = SchedModel(sched, lr=0.02)
    make_trainer(tmp_path, max_steps=steps, callbacks=[*callbacks, rec], **kw).fit(model)
    return rec


# ---------------------------------------------------------------------------------------------------- TRELLIS / eps
@pytest.mark.parametrize("foreach", [False, None])
def test_trellis_eps_underflow_in_16_true_is_prevented(tmp_path: Any, foreach: bool | None) -> None:
    def run(precision: str, callbacks: list[Callback]) -> TinyModel:
        pl.seed_everything(0, verbose=False)
        model = TinyModel(lr=0.01, eps=1e-8, foreach=foreach)
        make_trainer(tmp_path, precision=precision, max_steps=80, callbacks=callbacks).fit(model)
        return model

    broken = run("16-true", [])
    assert math.isnan(broken.losses[1])  # NaN right after the first update: 1e-8 is 0 in fp16
    assert not all_finite(broken)

    with pytest.warns(UserWarning, match=r"eps=1e-08 is 0 in float16.*Fixed: nanguard set eps 1e-08 -> 0.0001"):
        saved = run("16-true", [OptimizerBackoff()])
    reference = run("32-true", [])
    assert all_finite(saved)
    assert all(math.isfinite(v) for v in saved.losses)
    final, ref = sum(saved.losses[-8:]) / 8, sum(reference.losses[-8:]) / 8
    # Both cut the loss by >50x from ~0.24; fp16 weights and eps=1e-4 vs 1e-8 cost at most a factor 2 (measured 0.76x).
    assert final < saved.losses[0] / 50
    assert 0.5 * ref < final < 2.0 * ref


def test_preflight_raise_and_warn(tmp_path: Any) -> None:
    with pytest.raises(UnsupportedSetupError, match=r'on_hazard="raise"\): optimizer 0 \(AdamW\) group 0: eps=1e-08'):
        make_trainer(tmp_path, precision="16-true", callbacks=[OptimizerBackoff(on_hazard="raise")]).fit(
            TinyModel(eps=1e-8)
        )
    model = TinyModel(eps=1e-8)
    trainer = make_trainer(tmp_path, precision="16-true", max_steps=1, callbacks=[OptimizerBackoff(on_hazard="warn")])
    # Reported, not fixed: the first update divides by eps=0 and the fit refuses to return NaN weights.
    with (
        pytest.warns(UserWarning, match="eps=1e-08 is 0 in float16") as record,
        pytest.raises(NonFiniteTrainingError, match="training ended with non-finite parameters"),
    ):
        trainer.fit(model)
    assert not any("Fixed" in str(w.message) for w in record)
    assert trainer.optimizers[0].param_groups[0]["eps"] == 1e-8
    actions = [(i.action, i.trigger) for i in get_engine(trainer).sink.records]
    assert actions == [("preflight", "half_master"), ("preflight", "eps_underflow")]


def test_preflight_is_silent_for_a_healthy_setup(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, precision="bf16-mixed", max_steps=2, callbacks=[OptimizerBackoff()])
    trainer.fit(TinyModel(eps=1e-8))  # warnings are errors here: none may be raised
    assert get_engine(trainer).sink.records == []


def test_preflight_fused_optimizer_with_scaler_and_clipping(tmp_path: Any) -> None:
    trainer = make_trainer(
        tmp_path, precision="16-mixed", gradient_clip_val=1.0, callbacks=[OptimizerBackoff(on_hazard="raise")]
    )
    with pytest.raises(UnsupportedSetupError, match="fused and runs with a GradScaler and gradient clipping"):
        trainer.fit(TinyModel(fused=True))


@pytest.mark.parametrize(
    ("precision", "mode", "before", "after"),
    [
        ("32-true", "always", 1e-8, 1e-7),
        ("32-true", "auto", 1e-8, 1e-8),  # fp32 params: eps is not the problem, left alone
        ("16-true", "auto", 1e-4, 1e-3),  # preflight raised 1e-8 to 1e-4; the backoff multiplies by 10
    ],
)
def test_eps_backoff_takes_effect_at_the_next_step(
    tmp_path: Any, precision: str, mode: str, before: float, after: float
) -> None:
    rec = Recorder()
    cb = backoff(eps_backoff=mode, on_hazard="fix")
    faults = incidents_at([3], value=1e3 if precision == "16-true" else 1e6)  # float16 gradients: a finite jump
    trainer = make_trainer(tmp_path, precision=precision, max_steps=6, callbacks=[*faults, cb, rec])
    with pytest.warns(UserWarning, match="eps_underflow|eps=1e-08") if precision == "16-true" else _nothing():
        trainer.fit(TinyModel(lr=0.01, eps=1e-8))
    assert [rec.eps[s] for s in range(6)] == [pytest.approx(before)] * 4 + [pytest.approx(after)] * 2
    (incident,) = [i for i in get_engine(trainer).sink.records if i.action == "backoff"]
    assert incident.step == 3
    if before != after:
        assert incident.values["eps_after"] == {"opt0_group0": pytest.approx(after)}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ---------------------------------------------------------------------------------------------------- LR persistence
@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
def test_lr_backoff_persists_under_the_trainers_scheduler(tmp_path: Any, sched: str) -> None:
    ref = _fit(tmp_path, [*incidents_at([]), backoff()], sched=sched)
    got = _fit(tmp_path, [*incidents_at([3]), backoff()], sched=sched)
    ratios = [got.lr[s] / ref.lr[s] for s in range(12)]
    assert ratios == [pytest.approx(1.0)] * 4 + [pytest.approx(0.5)] * 8


@pytest.mark.parametrize("backoff_first", [True, False])
def test_trigger_is_independent_of_callback_order(tmp_path: Any, backoff_first: bool) -> None:
    ref = _fit(tmp_path, [OptimizerBackoff()])
    cbs: list[Callback] = [*incidents_at([2, 5]), backoff()]
    got = _fit(tmp_path, cbs[::-1] if backoff_first else cbs)
    ratios = [got.lr[s] / ref.lr[s] for s in range(12)]
    assert ratios == [pytest.approx(1.0)] * 3 + [pytest.approx(0.5)] * 3 + [pytest.approx(0.25)] * 6


@pytest.mark.parametrize("monitor_first", [True, False])
def test_recurring_skips_whose_remedy_is_a_lower_lr_trigger_backoff(tmp_path: Any, monitor_first: bool) -> None:
    ref = _fit(tmp_path, [GradNormMonitor(**SPIKE_SKIPS), OptimizerBackoff()])
    pair: list[Callback] = [GradNormMonitor(**SPIKE_SKIPS), OptimizerBackoff(skips_before_backoff=2, skip_window=5)]
    cb = pair[1]
    got = _fit(tmp_path, [FaultInjector("grad", steps=[2, 4], value=1e6), *(pair if monitor_first else pair[::-1])])
    ratios = [got.lr[s] / ref.lr[s] for s in range(12)]
    assert ratios == [pytest.approx(1.0)] * 5 + [pytest.approx(0.5)] * 7  # the 2nd skip (step 4) backs off
    assert isinstance(cb, OptimizerBackoff)
    assert cb.lr_scale == 0.5


def test_recurring_skips_a_lower_lr_does_not_fix_never_lower_it(tmp_path: Any) -> None:
    # A NaN loss at three steps that the replay does not reproduce (transient): the drop is its whole remedy.
    cb = OptimizerBackoff(skips_before_backoff=2, skip_window=10)
    # Every incident replayed, however loaded the machine (the replay budget is wall time: spent, a step is `unknown`).
    monitor = GradNormMonitor(max_replay_steps=1e9)
    rec = _fit(tmp_path, [FaultInjector("loss", steps=[2, 4, 6]), monitor, cb])
    assert [(i.step, i.cause, i.actions) for i in rec.incidents("skip")] == [
        (s, "transient", ["skip"]) for s in (2, 4, 6)
    ]
    assert cb.lr_scale == 1.0


def test_floor_and_recovery(tmp_path: Any) -> None:
    scales: dict[int, float] = {}

    class Scale(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            scales[trainer.global_step] = cb.lr_scale

    cb = backoff(min_lr_scale=0.25, recover_after=2, recover_steps=2)
    ref = _fit(tmp_path, [OptimizerBackoff()], steps=13)
    got = _fit(tmp_path, [*incidents_at([1, 2, 3]), cb, Scale()], steps=13)
    root2 = 2**0.5
    # Incidents at steps 1-3 (floor 0.25 at the third); steps 4 and 5 healthy -> one notch (x sqrt 2) at the end
    # of step 5 (global_step 6), and one more after every 2 healthy steps, up to 1.0.
    expected = {1: 1.0, 2: 0.5, 3: 0.25, 4: 0.25, 5: 0.25, 6: 0.25 * root2, 7: 0.25 * root2, 8: 0.5, 9: 0.5}
    expected.update({10: 0.5 * root2, 11: 0.5 * root2, 12: 1.0, 13: 1.0})
    assert scales == pytest.approx(expected)
    for s in range(1, 13):
        assert got.lr[s] / ref.lr[s] == pytest.approx(scales[s]), s
    floor = [i for i in got.incidents() if "already at its floor min_lr_scale=0.25" in i.message]
    assert [i.step for i in floor] == [3]


# ---------------------------------------------------------------------------------------------------- resume, rollback
def test_backoff_survives_save_checkpoint_and_resume(tmp_path: Any) -> None:
    ref = _fit(tmp_path, [OptimizerBackoff()], sched="OneCycleLR", steps=14)
    first = make_trainer(tmp_path, max_steps=6, callbacks=[*incidents_at([2]), backoff()])
    first.fit(SchedModel("OneCycleLR", lr=0.02))
    path = str(tmp_path / "backoff.ckpt")
    first.save_checkpoint(path)

    rec, cb = Recorder(), OptimizerBackoff()
    resumed = make_trainer(tmp_path, max_steps=14, callbacks=[GradNormMonitor(), cb, rec])
    resumed.fit(SchedModel("OneCycleLR", lr=0.02), ckpt_path=path)  # configure_optimizers asks for the full rate
    assert cb.lr_scale == 0.5
    assert sorted(rec.lr) == list(range(6, 14))
    for s in range(6, 14):
        assert rec.lr[s] / ref.lr[s] == pytest.approx(0.5), s
    assert get_engine(resumed).sink.records == []  # already consistent: nothing re-applied


def test_callback_added_on_resume_adopts_the_baked_in_scale(tmp_path: Any) -> None:
    first = make_trainer(tmp_path, max_steps=6, callbacks=[*incidents_at([2]), backoff(lr_factor=0.25)])
    first.fit(SchedModel("LambdaLR", lr=0.02))
    path = str(tmp_path / "adopt.ckpt")
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    del ckpt["callbacks"]["OptimizerBackoff"]  # a checkpoint of a run without the callback
    torch.save(ckpt, path)
    cb = OptimizerBackoff()
    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):  # the first run's monitor
        make_trainer(tmp_path, max_steps=8, callbacks=[cb]).fit(SchedModel("LambdaLR", lr=0.02), ckpt_path=path)
    assert cb.lr_scale == 0.25


@pytest.mark.parametrize("backoff_first", [True, False])
def test_backoff_is_reapplied_once_after_a_rollback(tmp_path: Any, backoff_first: bool) -> None:
    def cbs(incidents: list[int]) -> list[Callback]:
        pair: list[Callback] = [RollbackSim(snap_at=2, restore_after=5), backoff()]
        return [*incidents_at(incidents), *(pair[::-1] if backoff_first else pair)]

    ref = _fit(tmp_path, cbs([]))
    got_cbs = cbs([3])
    got = _fit(tmp_path, got_cbs)
    ratios = [got.lr[s] / ref.lr[s] for s in range(12)]
    # The restored state (taken at step 2) carried the full rate; the factor is back on it, once.
    assert ratios == [pytest.approx(1.0)] * 4 + [pytest.approx(0.5)] * 8
    # One incident (the event that backed off); the re-application after the restore is bookkeeping, not an event.
    assert [(i.step, i.actions) for i in got.incidents()] == [(3, ["skip", "backoff"])]


# ---------------------------------------------------------------------------------------------------- logging, config
def test_logs_lr_scale_and_per_group_eps(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    model = SchedModel("LambdaLR", groups_eps=(1e-8, 1e-6))
    cb = backoff(eps_backoff="always")
    make_trainer(tmp_path, max_steps=4, logger=logger, callbacks=[*incidents_at([1]), cb]).fit(model)
    rows = csv_metrics(logger.log_dir)
    scale = [float(r["nanguard/lr_scale"]) for r in rows if r.get("nanguard/lr_scale")]
    assert scale == [1.0, 0.5, 0.5, 0.5]
    eps0 = [float(r["nanguard/eps/opt0_group0"]) for r in rows if r.get("nanguard/eps/opt0_group0")]
    eps1 = [float(r["nanguard/eps/opt0_group1"]) for r in rows if r.get("nanguard/eps/opt0_group1")]
    assert eps0 == pytest.approx([1e-8, 1e-7, 1e-7, 1e-7])
    assert eps1 == pytest.approx([1e-6, 1e-5, 1e-5, 1e-5])
    assert any(r.get("nanguard/incident/backoff") for r in rows)


def test_logs_single_eps_key_when_groups_agree(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    make_trainer(tmp_path, max_steps=2, logger=logger, callbacks=[OptimizerBackoff()]).fit(SchedModel())
    rows = csv_metrics(logger.log_dir)
    assert [float(r["nanguard/eps"]) for r in rows if r.get("nanguard/eps")] == [1e-8, 1e-8]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr_factor": 1.0}, r"OptimizerBackoff\(lr_factor=1.0\): must be a number in \(0.0, 1.0\)"),
        ({"lr_factor": 0}, r"lr_factor=0\)"),
        ({"min_lr_scale": 0.0}, r"min_lr_scale=0.0\): must be a number in \(0.0, 1.0\]"),
        ({"triggers": "rollback,oops"}, r"triggers='rollback,oops'\): unknown trigger\(s\) \['oops'\]"),
        ({"triggers": ["rollback"]}, r"triggers=\['rollback'\]\): must be a comma-separated string"),
        ({"skips_before_backoff": 0}, r"skips_before_backoff=0\): must be an int >= 1"),
        ({"recover_after": 0}, r"recover_after=0\): must be an int or None >= 1"),
        ({"recover_with_schedule": "yes"}, r"recover_with_schedule='yes'\): must be one of \[False, True\]"),
        ({"eps_backoff": "sometimes"}, r"eps_backoff='sometimes'\): must be one of"),
        ({"eps_factor": 1.0}, r"eps_factor=1.0\): must be a number in \(1.0, 1000000.0\]"),
        ({"max_eps": 0.0}, r"max_eps=0.0\)"),
        ({"on_hazard": "ignore"}, r"on_hazard='ignore'\): must be one of \['fix', 'off', 'raise', 'warn'\]"),
        ({"safe_eps": math.nan}, r"safe_eps=nan\)"),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(NanGuardConfigError, match=match):
        OptimizerBackoff(**kwargs)


def test_state_round_trip_weights_only(tmp_path: Any) -> None:
    cb = OptimizerBackoff()
    cb._policy.back_off("unknown")
    cb._policy.back_off("gradient_explosion")
    cb._scales.eps_scale = 10.0
    path = tmp_path / "state.pt"
    torch.save(cb.state_dict(), path)
    other = OptimizerBackoff()
    other.load_state_dict(torch.load(path, weights_only=True))
    assert other.state_dict() == cb.state_dict()
    assert other.lr_scale == 0.25
    assert other.eps_scale == 10.0
    OptimizerBackoff().load_state_dict({})  # tolerant of older/empty state
    assert OptimizerBackoff(lr_factor=0.5).state_key == OptimizerBackoff(lr_factor=0.25).state_key  # one per Trainer


class ManualModel(SchedModel):
    """Manual optimization: the module steps its own scheduler inside training_step."""

    def __init__(self) -> None:
        super().__init__("LambdaLR", lr=0.02)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        sched.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization(tmp_path: Any) -> None:
    def fit(steps: list[int]) -> Recorder:
        rec = Recorder()
        make_trainer(tmp_path, max_steps=8, callbacks=[*incidents_at(steps), backoff(), rec]).fit(ManualModel())
        return rec

    ref, got = fit([]), fit([3])
    ratios = [got.lr[s] / ref.lr[s] for s in range(8)]
    assert ratios == [pytest.approx(1.0)] * 4 + [pytest.approx(0.5)] * 4
