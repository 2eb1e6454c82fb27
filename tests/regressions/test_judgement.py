"""Judgement you can trust: a measurement outranks a heuristic, a data blame is tested before its quarantine, and a
quarantine that does not stop the fault withdraws its blame. Real fits, short runs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import default_callbacks
from lightning_nanguard.engine import get_engine
from tests.helpers import make_trainer


def _monitor(trainer: pl.Trainer) -> Any:
    return next(c for c in trainer.callbacks if type(c).__name__ == "GradNormMonitor")  # type: ignore[attr-defined]


class ClassConditional(pl.LightningModule):
    """A class-conditional generator: integer labels (0..9) condition the model through an embedding, its output has
    8 channels. The labels are an input, not targets; a 10x learning-rate jump blows the weights up by finite
    updates until the forward overflows."""

    def __init__(self, jump_at: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        self.jump_at = jump_at

    def forward(self, z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, self.embed(c)], -1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, c = batch
        if self.global_step == self.jump_at:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 5.0  # 10x
        return nn.functional.mse_loss(self(x[:, :8], c), x[:, 8:] * 3)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, c = torch.randn(256, 16, generator=g), torch.randint(0, 10, (256,), generator=g)
        return DataLoader(TensorDataset(x, c), batch_size=16)


@pytest.mark.parametrize("probe", [True, False], ids=["preset", "spikes-not-probed"])
def test_a_class_conditional_model_after_an_lr_jump_is_rolled_back_not_quarantined(tmp_path: Any, probe: bool) -> None:
    """The preset's probe catches the blow-up at its first spike, while everything is finite; with spikes not probed,
    the parameters' growth since the last sound snapshot is measured at the first NaN. Either way it is a measured
    state that decides: rolled back, and no label blamed."""
    torch.manual_seed(0)
    overrides = {} if probe else {"GradNormMonitor": {"spike_zscore": None, "on_spike": "warn"}}
    trainer = make_trainer(tmp_path, max_steps=32, callbacks=default_callbacks(**overrides))
    trainer.fit(ClassConditional())
    records = get_engine(trainer).sink.records
    assert records, "the run must have met the fault"
    first = records[0]
    assert "rollback" in [str(a) for a in first.actions]
    assert first.diagnosis["decided_by"] == "measured_state"
    if probe:
        assert first.cause.value == "weights_diverging"
    else:
        assert first.cause.value == "gradient_explosion"
        assert first.diagnosis["where"].startswith("parameters grown since the snapshot of step ")
    assert not any(r.cause.value == "targets" for r in records)
    assert _monitor(trainer).quarantined_samples == []


class ConditionedHead(pl.LightningModule):
    """Labels 0..9 condition the model through an embedding; the head has 5 outputs, so the labels 'do not fit' it.
    At batch 2 the model's own formula goes NaN for every row (an acos past 1): the labels are innocent."""

    def __init__(self, outsized_row: bool = False, embed: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(12 if embed else 18, 16)
        self.head = nn.Linear(16, 5)
        self.outsized_row, self.use_embed = outsized_row, embed

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, c = batch
        cond = self.embed(c) if self.use_embed else (c[:, None] == torch.arange(10)).float()  # a one-hot by hand
        h = torch.tanh(self.body(torch.cat([x, cond], -1)))
        if batch_idx == 2:
            h = h + torch.acos(x[:, :1].abs() + 1.5)  # acos past 1: NaN, from finite inputs, on every row
        return self.head(h).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, c = torch.randn(64, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
        if self.outsized_row:
            x[2 * 8 + 3] *= 1e5  # batch 2 row 3: an outsized but finite record
        return DataLoader(TensorDataset(x, c), batch_size=8)


def test_labels_that_index_an_embedding_condition_the_model_and_are_no_targets(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, max_steps=4, callbacks=default_callbacks())
    trainer.fit(ConditionedHead())
    [record] = get_engine(trainer).sink.records
    d = record.diagnosis
    assert "targets_out_of_range" not in [e["kind"] for e in d["evidence"]]
    assert d["counterfactual"] == {}  # no data was blamed, so none was tested
    assert record.cause.value != "targets"
    assert _monitor(trainer).quarantined_samples == []


def test_labels_blamed_by_the_heuristic_are_tested_and_not_quarantined(tmp_path: Any) -> None:
    """Class labels beyond the head (one-hot by hand, no embedding), no origin pattern: the heuristic blames them, the
    step replayed without them is still NaN, so nothing is quarantined and the cause is decided from the rest."""
    trainer = make_trainer(tmp_path, max_steps=4, callbacks=default_callbacks())
    trainer.fit(ConditionedHead(embed=False))
    [record] = get_engine(trainer).sink.records
    d = record.diagnosis
    assert record.cause.value != "targets"
    assert d["counterfactual"]["tested"]
    assert not d["counterfactual"]["finite"]
    assert "counterfactual" in [e["kind"] for e in d["evidence"]]
    assert "quarantine" not in [str(a) for a in record.actions]
    assert _monitor(trainer).quarantined_samples == []


def test_a_blame_no_replay_can_test_quarantines_nothing_unless_the_record_holds_nan(tmp_path: Any) -> None:
    """forensics='off': the outsized (finite) record is only a hypothesis no replay can test: not quarantined."""
    from lightning_nanguard import GradNormMonitor

    trainer = make_trainer(tmp_path, max_steps=4, callbacks=[GradNormMonitor(forensics="off")])
    trainer.fit(ConditionedHead(outsized_row=True))
    [record] = get_engine(trainer).sink.records
    d = record.diagnosis
    assert d["counterfactual"] == {"rows": [3], "tested": False, "why": "forensics='off'", "quarantine": False}
    assert "could not be tested" in d["note"]
    assert [str(a) for a in record.actions] == ["skip"]
    assert _monitor(trainer).quarantined_samples == []


def test_a_record_whose_removal_makes_the_step_finite_is_quarantined_with_the_counterfactual(tmp_path: Any) -> None:
    from tests.forensics.models import BAD_BATCH, BATCH, RegressionNet

    trainer = make_trainer(tmp_path, max_steps=4, callbacks=default_callbacks())
    trainer.fit(RegressionNet(bad_rows=(BAD_BATCH * BATCH + 3,)))
    [record] = get_engine(trainer).sink.records
    d = record.diagnosis
    assert record.cause.value == "input_data"
    assert d["decided_by"] == "measured_origin"
    assert d["counterfactual"]["finite"]
    assert d["counterfactual"]["quarantine"]
    assert _monitor(trainer).quarantined_samples == [BAD_BATCH * BATCH + 3]


class GrowingSoftmax(pl.LightningModule):
    """A hand-written softmax whose logits grow with the model's state (a temperature that sharpens every step): once
    they pass 88.7, exp overflows, first on the records with the largest logits, then on fresh ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.register_buffer("sharpness", torch.tensor(20.0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = self.body(x) * self.sharpness
        p = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
        return -torch.log(p.gather(1, y[:, None]).clamp_min(1e-30)).mean()

    def on_train_batch_end(self, *args: Any) -> None:
        self.sharpness *= 1.5

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)


def test_a_state_driven_formula_fault_withdraws_its_trigger_blame_at_the_first_recurrence(tmp_path: Any) -> None:
    from lightning_nanguard import GradNormMonitor
    from tests.forensics.test_forensics_fit import _EveryEvent

    events = _EveryEvent()
    callbacks = [c for c in default_callbacks() if not isinstance(c, GradNormMonitor)]
    monitor = GradNormMonitor(max_replay_steps=1e9)  # a traced replay for each incident, however loaded the machine
    trainer = make_trainer(tmp_path, max_steps=8, callbacks=[*callbacks, monitor, events])
    trainer.fit(GrowingSoftmax())
    causes = [d["cause"] for d in events.diagnoses]
    assert causes[:2] == ["exp_overflow", "exp_overflow"]
    first, second = events.diagnoses[:2]
    assert first["caused_by_data"]  # quarantined as the trigger (tested: finite without it)
    assert not second["caused_by_data"]
    assert "withdrawn" in [e["kind"] for e in second["evidence"]]
    assert "released" in next(e for e in second["evidence"] if e["kind"] == "withdrawn")["summary"]
    assert not any(d["caused_by_data"] for d in events.diagnoses[1:])
    assert _monitor(trainer).quarantined_samples == []  # released


class ManualAccumulation(pl.LightningModule):
    """Hand-written accumulation under manual optimization: ``manual_backward`` every batch, a step every 2nd."""

    def __init__(self, bad_sample: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.bad_sample = bad_sample

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        opt = self.optimizers()
        loss = nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0:
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad()  # type: ignore[union-attr]
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        x[self.bad_sample, 2] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=16)


def test_manual_accumulation_finds_a_nan_record_in_the_window_first_micro_batch(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=2, callbacks=default_callbacks())
    trainer.fit(ManualAccumulation(bad_sample=37))  # batch 2 row 5: the first micro-batch of the window (2, 3)
    [record] = get_engine(trainer).sink.records
    assert record.cause.value == "input_data"
    assert record.where == "batch 2 rows [5]"
    assert "quarantine" in [str(a) for a in record.actions]
    assert _monitor(trainer).quarantined_samples == [37]


class CompiledFeatures(pl.LightningModule):
    """A ``torch.compile``d model whose data holds a record with a -inf feature and one with a NaN feature."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def configure_model(self) -> None:
        self.net = torch.compile(self.net, backend="eager")  # type: ignore[assignment]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        x[10, 3] = float("-inf")  # batch 1 row 2: a log-feature of 0, not a mask
        x[35, 1] = float("nan")  # batch 4 row 3
        return DataLoader(TensorDataset(x, y), batch_size=8)


def test_a_compiled_model_quarantines_minus_inf_and_nan_records_at_their_first_incident(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=2, callbacks=default_callbacks())
    trainer.fit(CompiledFeatures())
    records = get_engine(trainer).sink.records
    assert [(r.step, r.cause.value, r.where) for r in records] == [
        (1, "input_data", "batch 1 rows [2]"),
        (4, "input_data", "batch 4 rows [3]"),
    ]
    assert all(r.count == 1 for r in records)  # neither comes back in the second epoch
    assert records[0].diagnosis["origin"]["produced"] == "-inf"
    assert _monitor(trainer).quarantined_samples == [10, 35]


class ManualGAN(pl.LightningModule):
    """A GAN trained with manual optimization, a hand-written discriminator loss: one noise record drives the
    discriminator's logit on its fake past ~6, where sigmoid rounds to 1.0 in bf16 and log(1 - p) is log(0)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Linear(4, 8)
        self.disc = nn.Linear(8, 1)
        with torch.no_grad():
            self.gen.weight.abs_()
            self.disc.weight.abs_()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        fake = self.gen(z)
        p_real, p_fake = torch.sigmoid(self.disc(real)), torch.sigmoid(self.disc(fake.detach()))
        d_loss = -(torch.log(p_real) + torch.log(1 - p_fake)).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = -torch.log(torch.sigmoid(self.disc(fake))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.gen.parameters(), lr=1e-3), torch.optim.SGD(self.disc.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        real, z = torch.randn(32, 8, generator=g) * 0.1, torch.rand(32, 4, generator=g) * 0.1
        z[2 * 8 + 5] = 8.0  # batch 2 row 5
        return DataLoader(TensorDataset(real, z), batch_size=8)


def test_a_manual_optimization_gan_names_the_op_and_line_of_its_log_of_zero(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=1, precision="bf16-mixed", callbacks=default_callbacks())
    trainer.fit(ManualGAN())
    records = get_engine(trainer).sink.records
    assert records, "the run must have met the fault"
    d = records[0].diagnosis
    assert d["cause"] in ("low_precision_rounding", "log_of_zero")
    assert d["origin"]["op"] == "aten.log.default"
    assert d["origin"]["frame"]["code"] == "d_loss = -(torch.log(p_real) + torch.log(1 - p_fake)).mean()"
    assert d["decided_by"] == "measured_origin"


class ZeroRecords(pl.LightningModule):
    """A normalisation without eps; five all-zero records in batch 1 trigger it at once."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = x / x.norm(dim=-1, keepdim=True)
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        x[16:21] = 0.0  # batch 1 rows 0-4
        return DataLoader(TensorDataset(x, y), batch_size=16)


def test_a_quarantined_share_past_the_budget_withdraws_the_blame(tmp_path: Any) -> None:
    """Five of 64 records 'trigger' the formula: past max_quarantined_fraction (never fewer than 4 records), the
    records are released and the incident and the summary say so."""
    import json
    import os

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=default_callbacks(), logger=logger)
    trainer.fit(ZeroRecords())
    [record] = get_engine(trainer).sink.records
    assert record.cause.value == "division_by_zero"
    with open(os.path.join(logger.log_dir, "nanguard", "quarantine.json")) as f:
        assert json.load(f)["samples"] == []  # the file says they were released
    assert "past max_quarantined_fraction=0.005" in record.message
    assert _monitor(trainer).quarantined_samples == []
    assert any("max_quarantined_fraction" in line for line in get_engine(trainer).incidents.blames.lines)


class EveryNSteps(pl.LightningModule):
    """A regulariser added every 4th step divides by a statistic that is 0 on this data: NaN every 4th step."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(x), y)
        if self.global_step % 4 == 3:
            loss = loss + (x[:, :1] * 0).sum() / (x[:, :1] * 0).sum()  # 0 / 0, from finite inputs
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)


def test_a_term_added_every_n_steps_names_its_op_and_line(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, max_steps=5, callbacks=default_callbacks())
    trainer.fit(EveryNSteps())
    [record] = get_engine(trainer).sink.records
    d = record.diagnosis
    assert record.cause.value == "division_by_zero"
    assert d["origin"]["op"] == "aten.div.Tensor"
    assert d["origin"]["frame"]["code"].startswith("loss = loss + (x[:, :1] * 0).sum() / (x[:, :1] * 0).sum()")
