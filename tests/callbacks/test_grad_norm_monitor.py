"""GradNormMonitor on real Trainer.fit runs with deterministic fault injection."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_nanguard import AutoRollback, GradNormMonitor, NanGuardConfigError, NonFiniteTrainingError
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import (
    PRECISIONS,
    TinyModel,
    all_finite,
    csv_metrics,
    loggers,
    make_trainer,
    params_of,
    tb_scalars,
    tb_tags,
)


class ParamsAtBatchStart(pl.Callback):
    """Records the parameters at the start of every optimizer step (keyed by global_step)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}
        self.adam_steps: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.at.setdefault(trainer.global_step, params_of(pl_module))
        state = trainer.optimizers[0].state
        steps = [float(s["step"]) for s in state.values() if "step" in s]
        self.adam_steps.setdefault(trainer.global_step, max(steps, default=0.0))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("target", ["loss", "grad"])
def test_bad_step_is_skipped_and_recorded(tmp_path: Any, precision: str, value: str, target: str) -> None:
    spy = ParamsAtBatchStart()
    monitor = GradNormMonitor()
    trainer = make_trainer(
        tmp_path,
        precision,
        logger=loggers(tmp_path),
        callbacks=[FaultInjector(target, steps=[2], value=value), monitor, spy],
    )
    model = TinyModel()
    trainer.fit(model)

    assert _same(spy.at[2], spy.at[3]), "the poisoned update landed"
    assert not _same(spy.at[1], spy.at[2]), "healthy steps must still update"
    assert spy.adam_steps[3] == spy.adam_steps[2], "Adam's step count moved on a skipped step"
    assert all_finite(model)
    assert monitor.skipped_steps == 1
    records = get_engine(trainer).sink.records
    assert [(r.step, r.action) for r in records] == [(2, "scaler_skip" if precision == "16-mixed" else "skip")]
    assert records[0].trigger.startswith("nonfinite")

    tb_dir = os.path.join(tmp_path, "tb", "version_0")
    with open(os.path.join(tb_dir, "nanguard", "incidents.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 1
    assert lines[0]["step"] == 2
    assert lines[0]["ranks"] == [0]
    assert lines[0]["batch_idx"] == 2
    # Who dropped the update: the GradScaler itself under 16-mixed (its found_inf), GradNormMonitor otherwise.
    assert lines[0]["source"] == ("GradScaler" if precision == "16-mixed" else "GradNormMonitor")
    assert {"step", "epoch", "batch_idx", "ranks", "trigger", "values", "action", "budget_left"} <= lines[0].keys()

    scalars = tb_scalars(tb_dir)
    assert [v for _, v in scalars["nanguard/skipped_steps"]][-1] == 1.0
    # The last finite norm on every healthy step; the interval's max is inf at the bad step, so it is never hidden.
    assert [s for s, _ in scalars["nanguard/grad_norm"]] == [0, 1, 3, 4, 5]
    assert [s for s, v in scalars["nanguard/grad_norm_max"] if math.isinf(v)] == [2]
    assert [v for _, v in scalars["nanguard/nonfinite_steps"]] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert "nanguard/incident/" + records[0].action in scalars
    assert "nanguard/incidents/text_summary" in tb_tags(tb_dir)["tensors"]

    rows = csv_metrics(os.path.join(tmp_path, "csv", "version_0"))
    skipped = [float(r["nanguard/skipped_steps"]) for r in rows if r.get("nanguard/skipped_steps")]
    assert skipped[-1] == 1.0
    assert sum(1 for r in rows if r.get("nanguard/grad_norm_max")) == 6


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_accumulated_window_with_bad_micro_batch_is_skipped(tmp_path: Any, precision: str) -> None:
    spy = ParamsAtBatchStart()
    monitor = GradNormMonitor()
    trainer = make_trainer(
        tmp_path, precision, accumulate_grad_batches=2, callbacks=[FaultInjector("loss", steps=[1]), monitor, spy]
    )
    model = TinyModel()
    trainer.fit(model)
    assert _same(spy.at[1], spy.at[2])
    assert not _same(spy.at[2], spy.at[3])
    assert monitor.skipped_steps == 1
    assert all_finite(model)


def test_budget_exhausted_stops_with_error_and_finite_weights(tmp_path: Any) -> None:
    monitor = GradNormMonitor(max_consecutive_skips=2)
    trainer = make_trainer(tmp_path, max_steps=10, callbacks=[FaultInjector("loss", steps=range(3, 10)), monitor])
    model = TinyModel()
    with pytest.raises(
        NonFiniteTrainingError, match=r"global_step=5.*3 dropped updates in a row.*max_consecutive_skips=2"
    ):
        trainer.fit(model)
    assert trainer.global_step == 6  # stopped after the batch that exhausted the budget
    assert all_finite(model)
    actions = [r.action for r in get_engine(trainer).sink.records]
    assert actions == ["skip", "skip", "stop"]


def test_stop_mode_stops_at_first_bad_step(tmp_path: Any) -> None:
    trainer = make_trainer(
        tmp_path, max_steps=10, callbacks=[FaultInjector("grad", steps=[4]), GradNormMonitor("stop")]
    )
    model = TinyModel()
    with pytest.raises(NonFiniteTrainingError, match="global_step=4"):
        trainer.fit(model)
    assert all_finite(model)


def test_warn_mode_lets_update_through_and_warns(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("loss", steps=[2]), GradNormMonitor("warn")])
    model = TinyModel()
    # Documented: warn is for diagnosis only. The update lands, and a fit never returns non-finite weights.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteTrainingError, match="training ended with non-finite parameters"):
            trainer.fit(model)
    said = [str(w.message) for w in caught if "let the update through" in str(w.message)]
    assert said
    assert re.search(r"global_step=2.*let the update through \(on_nonfinite='warn'\)", said[0])
    assert not all_finite(model)
    first = get_engine(trainer).sink.records[0]
    assert (first.step, first.actions) == (2, ["warn"])
    assert first.cause != "corrupt_state"  # judged on the state before the update it let through


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_healthy_run_is_bit_identical_with_and_without_monitor(tmp_path: Any, precision: str) -> None:
    def run(callbacks: list[pl.Callback]) -> dict[str, torch.Tensor]:
        pl.seed_everything(7, verbose=False)
        model = TinyModel()
        make_trainer(tmp_path, precision, max_steps=8, gradient_clip_val=0.5, callbacks=callbacks).fit(model)
        return params_of(model)

    plain = run([])
    guarded = run([GradNormMonitor(layer_depth=2, histogram=True)])
    assert _same(plain, guarded)


def test_per_layer_norms_and_clipped_norm_reach_tensorboard(tmp_path: Any) -> None:
    monitor = GradNormMonitor(layer_depth=1, log_every_n_steps=2, histogram=True)
    trainer = make_trainer(tmp_path, logger=loggers(tmp_path), gradient_clip_val=0.01, callbacks=[monitor])
    trainer.fit(TinyModel())
    scalars = tb_scalars(os.path.join(tmp_path, "tb", "version_0"))
    layer_keys = sorted(k for k in scalars if k.startswith("nanguard/layer_grad_norm/"))
    assert layer_keys == ["nanguard/layer_grad_norm/body", "nanguard/layer_grad_norm/head"]
    assert [s for s, _ in scalars["nanguard/layer_grad_norm/body"]] == [1, 3, 5]
    pre = dict(scalars["nanguard/grad_norm"])
    post = dict(scalars["nanguard/grad_norm_clipped"])
    assert set(post) == set(pre)
    for step, clipped in post.items():
        assert clipped <= 0.01 * 1.001 < pre[step]
        # the total of the per-layer norms is the total norm
    body, head = dict(scalars["nanguard/layer_grad_norm/body"]), dict(scalars["nanguard/layer_grad_norm/head"])
    for step in body:
        assert math.isclose(math.hypot(body[step], head[step]), pre[step], rel_tol=1e-4)


def test_fused_optimizer_with_scaler_reports_unscaled_norm(tmp_path: Any) -> None:
    def norms(fused: bool) -> list[float]:
        pl.seed_everything(3, verbose=False)
        model = TinyModel(fused=fused) if fused else TinyModel(foreach=False)
        trainer = make_trainer(
            tmp_path / str(fused), "16-mixed", logger=loggers(tmp_path / str(fused)), callbacks=[GradNormMonitor()]
        )
        trainer.fit(model)
        scalars = tb_scalars(os.path.join(tmp_path / str(fused), "tb", "version_0"))
        return [v for _, v in scalars["nanguard/grad_norm"]]

    fused, plain = norms(True), norms(False)
    assert fused == pytest.approx(plain, rel=1e-3)


def test_fused_optimizer_with_scaler_bad_step_is_skipped(tmp_path: Any) -> None:
    spy = ParamsAtBatchStart()
    trainer = make_trainer(tmp_path, "16-mixed", callbacks=[FaultInjector("grad", steps=[2]), GradNormMonitor(), spy])
    model = TinyModel(fused=True)
    trainer.fit(model)
    assert _same(spy.at[2], spy.at[3])
    assert all_finite(model)


def test_state_round_trips_through_weights_only_checkpoint(tmp_path: Any) -> None:
    monitor = GradNormMonitor(max_consecutive_skips=3)
    trainer = make_trainer(tmp_path, max_steps=8, callbacks=[FaultInjector("loss", steps=[2, 7]), monitor])
    trainer.fit(TinyModel())  # 8 steps = one full epoch, so the resume is at an epoch boundary
    path = os.path.join(tmp_path, "a.ckpt")
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    state = ckpt["callbacks"][monitor.state_key]
    assert state["skipped_steps"] == 2

    resumed = GradNormMonitor(max_consecutive_skips=3)
    trainer2 = make_trainer(tmp_path, max_steps=12, callbacks=[resumed])
    trainer2.fit(TinyModel(), ckpt_path=path, weights_only=True)
    assert resumed.skipped_steps == 2


def test_manual_optimization_skip(tmp_path: Any) -> None:
    class Manual(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    spy = ParamsAtBatchStart()
    trainer = make_trainer(tmp_path, callbacks=[FaultInjector("loss", steps=[2]), GradNormMonitor(), spy])
    model = Manual()
    trainer.fit(model)
    assert _same(spy.at[2], spy.at[3])
    assert all_finite(model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"on_nonfinite": "ignore"},
            r"GradNormMonitor\(on_nonfinite='ignore'\): must be one of \['skip', 'stop', 'warn'\]",
        ),
        ({"max_consecutive_skips": 0}, r"GradNormMonitor\(max_consecutive_skips=0\): must be an int >= 1"),
        ({"layer_depth": 0}, r"GradNormMonitor\(layer_depth=0\): must be an int or None >= 1"),
        ({"log_every_n_steps": 2.5}, r"GradNormMonitor\(log_every_n_steps=2.5\): must be an int or None >= 1"),
        ({"histogram": "yes"}, r"GradNormMonitor\(histogram='yes'\)"),
        (
            {"max_dropped_fraction": 1.5},
            r"GradNormMonitor\(max_dropped_fraction=1.5\): must be a number in \[0.0, 1.0\] or None",
        ),
        ({"dropped_window": 0}, r"GradNormMonitor\(dropped_window=0\): must be an int >= 1"),
        (
            {"on_dropped_budget": "ignore"},
            r"GradNormMonitor\(on_dropped_budget='ignore'\): must be one of \['stop', 'warn'\]",
        ),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(NanGuardConfigError, match=match):
        GradNormMonitor(**kwargs)


def test_clipped_norm_is_logged_again_after_a_skipped_step(tmp_path: Any) -> None:
    # The skipped step has no clipped gradients; the healthy steps after it must not inherit its outcome.
    trainer = make_trainer(
        tmp_path,
        logger=loggers(tmp_path),
        gradient_clip_val=0.01,
        callbacks=[FaultInjector("loss", steps=[2]), GradNormMonitor()],
    )
    trainer.fit(TinyModel())
    scalars = tb_scalars(os.path.join(tmp_path, "tb", "version_0"))
    assert [s for s, _ in scalars["nanguard/grad_norm_clipped"]] == [0, 1, 3, 4, 5]


class _EmptyFirstGroupModel(TinyModel):
    def configure_optimizers(self) -> Any:
        # A weight-decay split whose first group ends up empty (no parameter matched its filter).
        return torch.optim.AdamW([{"params": [], "weight_decay": 0.0}, {"params": list(self.parameters())}], lr=0.05)


def test_an_optimizer_whose_first_param_group_is_empty_is_read_every_step(tmp_path: Any) -> None:
    # The per-step check that the cached parameter index still fits the optimizer read groups[0]["params"][0] and
    # raised IndexError at the second step.
    faults = FaultInjector("grad", steps=3, value="nan")
    monitor = GradNormMonitor()
    trainer = make_trainer(tmp_path, callbacks=[monitor, faults], max_steps=6)
    model = _EmptyFirstGroupModel()
    trainer.fit(model)
    incidents = get_engine(trainer).sink.log.records
    assert [(i.step, i.action) for i in incidents] == [(3, "skip")]
    assert all_finite(model)


def test_a_resume_measures_the_loss_s_progress_as_the_uninterrupted_fit(tmp_path: Any) -> None:
    # Under on_spike="probe" the loss's progress (where it started, its recent medians: what a climb is measured
    # against) is saved with the spike statistics, so a resumed fit does not start it again from the resume's level.
    def callbacks() -> list[Any]:
        return [GradNormMonitor(spike_zscore=3.0, spike_warmup=2, on_spike="probe"), AutoRollback()]

    def fit(root: str, steps: int, cbs: list[Any], ckpt: str | None = None) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        trainer = make_trainer(tmp_path / root, max_steps=steps, callbacks=cbs)
        trainer.fit(TinyModel(), ckpt_path=ckpt, weights_only=True)
        return trainer

    whole = callbacks()
    fit("whole", 16, whole)
    first = callbacks()
    path = os.path.join(tmp_path, "a.ckpt")
    fit("first", 8, first).save_checkpoint(path)  # one full epoch: the resume is at an epoch boundary
    saved = torch.load(path, weights_only=True)["callbacks"][first[0].state_key]["spike"]["climb"]
    assert len(saved["medians"]) == 4  # 8 losses: the medians of steps 0-4 ... 3-7
    second = callbacks()
    fit("second", 16, second, path)
    resumed, uninterrupted = second[0].state_dict()["spike"]["climb"], whole[0].state_dict()["spike"]["climb"]
    assert resumed["start"] == uninterrupted["start"] == saved["start"]  # measured from the fit's start
    assert len(resumed["medians"]) == len(uninterrupted["medians"]) == 12  # not 4: the medians went on
