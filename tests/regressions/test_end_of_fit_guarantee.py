"""The end-of-fit guarantee holds whatever callbacks run after the suite: a fit that returns normally has finite
parameters and buffers, whoever wrote them last; otherwise it raises a documented error.

Lightning's weight-averaging callbacks (``EMAWeightAveraging``, ``StochasticWeightAveraging``) copy their average into
the model in their ``on_train_end``; an average that took in a NaN update is NaN however well the suite repaired the
live weights. The end-of-fit check runs again in the first nanguard callback's ``teardown``, after every callback's
``on_train_end`` and ``on_fit_end`` (``../shared/repros/round3/ema_weight_averaging_returns_nan_after_final_check.py``).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from torch import nn

from lightning_nanguard import (
    AutoRollback,
    GradNormMonitor,
    NanGuardError,
    NonFiniteTrainingError,
    RecoveryBudgetExhausted,
    default_callbacks,
)
from lightning_nanguard.engine import get_engine
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, make_trainer

BATCHES = 8  # per epoch (TinyModel: 64 samples, batch size 8)


class FlakyAdamW(torch.optim.AdamW):
    """AdamW whose update at one step leaves a NaN in one weight, after the step check (an optimizer-numerics fault
    made deterministic: the suite sees it only at the next step, the averaging callback at once)."""

    def __init__(self, params: Any, bad_step: int, target: torch.Tensor, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.calls, self.bad_step, self.target = 0, bad_step, target

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        if self.calls == self.bad_step:
            self.target.view(-1)[0] = float("nan")
        self.calls += 1
        return loss


class FlakyModel(TinyModel):
    def __init__(self, bad_step: int) -> None:
        super().__init__(lr=0.01)
        self.bad_step = bad_step

    def configure_optimizers(self) -> Any:
        return FlakyAdamW(self.parameters(), bad_step=self.bad_step, target=self.head.weight, lr=self.lr)


class LateWriter(pl.Callback):
    """Writes a NaN into ``head.weight`` in ``on_fit_end``: the last hook before the callbacks' ``teardown``."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            pl_module.head.weight.view(-1)[0] = float("nan")


def finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in [*module.parameters(), *module.buffers()])


def averager(kind: str) -> pl.Callback:
    if kind == "ema":
        return EMAWeightAveraging(decay=0.9)
    return StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)


def fit(tmp_path: pathlib.Path, model: pl.LightningModule, callbacks: list[pl.Callback], **kw: Any) -> pl.Trainer:
    trainer = make_trainer(tmp_path, callbacks=callbacks, **{"max_steps": 3 * BATCHES, **kw})
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("place", ["after", "before"])
@pytest.mark.parametrize("kind", ["ema", "swa"])
def test_a_nan_average_is_never_returned(tmp_path: pathlib.Path, kind: str, place: str) -> None:
    # The update at the last step of epoch 0 leaves a NaN: EMA averages it in at that batch end, SWA at the start of
    # epoch 1 (its first averaged epoch), both before the suite sees it and rolls the live weights back.
    model = FlakyModel(bad_step=BATCHES - 1)
    suite = default_callbacks(AutoRollback={"every_n_steps": 4})
    callbacks = [*suite, averager(kind)] if place == "after" else [averager(kind), *suite]
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_steps=3 * BATCHES)
    try:
        trainer.fit(model)
    except NanGuardError:
        return  # a documented error: nothing returned to the user
    assert finite(model), "fit returned normally with non-finite weights"
    engine = get_engine(trainer)
    assert engine.ledger.final_state.startswith("finite")
    incidents = engine.sink.records
    assert any(i.cause is not None and i.cause.value == "corrupt_state" for i in incidents)
    if place == "after":  # the average was copied in after the first check: the second one restored it
        assert "after the end-of-fit check" in engine.ledger.final_state
        assert incidents[-1].values.get("restored_from_step") is not None


def test_a_healthy_average_is_returned_as_averaged(tmp_path: pathlib.Path) -> None:
    ema = EMAWeightAveraging(decay=0.9)
    model = TinyModel(lr=0.01)
    trainer = fit(tmp_path, model, [*default_callbacks(), ema])
    assert ema._average_model is not None
    averaged = dict(ema._average_model.module.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, averaged[name]), f"{name}: not the EMA average (the end-of-fit check touched it)"
    engine = get_engine(trainer)
    assert engine.sink.records == []
    assert engine.ledger.final_state == "finite (checked at the end of fit)"


def test_a_write_in_on_fit_end_is_restored(tmp_path: pathlib.Path) -> None:
    model = TinyModel(lr=0.01)
    trainer = fit(tmp_path, model, [*default_callbacks(AutoRollback={"every_n_steps": 4}), LateWriter()])
    assert finite(model)
    engine = get_engine(trainer)
    assert "after the end-of-fit check" in engine.ledger.final_state
    (incident,) = engine.sink.records
    assert incident.where == "head.weight"
    assert incident.values["restored_from_step"] == 3 * BATCHES - 4  # the newest snapshot (every 4 steps)


def test_a_write_in_on_fit_end_without_a_restorer_raises(tmp_path: pathlib.Path) -> None:
    model = TinyModel(lr=0.01)
    with pytest.raises(NonFiniteTrainingError, match="after the end-of-fit check"):
        fit(tmp_path, model, [GradNormMonitor(), LateWriter()])


def test_the_stop_error_comes_after_every_member_tore_down(tmp_path: pathlib.Path) -> None:
    # A recurring NaN exhausts the rollback budget: the error is raised by the last member's teardown, so every
    # member has released its per-fit state (AutoRollback's snapshots) and the callbacks can train again.
    rollback = AutoRollback(every_n_steps=2, max_rollbacks=2)
    callbacks = [FaultInjector("param", steps=list(range(3, 40)), value="nan"), rollback, GradNormMonitor()]
    with pytest.raises((RecoveryBudgetExhausted, NonFiniteTrainingError)):
        fit(tmp_path, TinyModel(lr=0.01), callbacks)
    assert rollback.ring.nbytes() == 0
    trainer = fit(tmp_path / "again", TinyModel(lr=0.01), [rollback, GradNormMonitor()], max_steps=4)
    assert get_engine(trainer).ledger.final_state == "finite (checked at the end of fit)"


@pytest.mark.parametrize("skipped", [{"max_steps": 0}, {"limit_train_batches": 0}])
def test_a_fit_that_runs_no_training_step_gets_its_check_and_summary(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, skipped: dict[str, int]
) -> None:
    """Lightning skips the training loop (no ``on_train_start``/``on_train_end``): a cross-validation helper's
    baseline fit with ``max_steps=0`` still gets the end-of-fit check and the summary
    (``../shared/repros/round5/zero_step_fit_prints_no_summary.py``)."""
    with caplog.at_level(logging.INFO):
        trainer = fit(tmp_path, TinyModel(lr=0.01), default_callbacks(), **skipped)
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nanguard summary")]
    assert "no incidents; no training step ran." in summary
    assert get_engine(trainer).ledger.final_state == "finite (checked at the end of fit)"


def test_a_fit_that_runs_no_training_step_never_returns_nan_weights(tmp_path: pathlib.Path) -> None:
    model = TinyModel(lr=0.01)
    with torch.no_grad():
        model.head.weight.view(-1)[0] = float("nan")  # loaded from a damaged file, say
    with pytest.raises(NonFiniteTrainingError, match=r"head\.weight"):
        fit(tmp_path, model, [GradNormMonitor()], max_steps=0)
