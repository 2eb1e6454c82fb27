"""Forensics on real ``Trainer.fit`` runs: each mechanism gives its cause class and names where it happened."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.engine import get_engine
from lightning_nanguard.engine.incidents import EventHandled
from lightning_nanguard.exceptions import NonFiniteTrainingError
from lightning_nanguard.testing import FaultInjector
from tests.forensics.models import (
    BAD_BATCH,
    BATCH,
    BatchNormNet,
    HandBCE,
    OverflowNet,
    RegressionNet,
    SoftTargetClassifier,
)
from tests.helpers import make_trainer


class _EveryEvent(pl.Callback):
    """Every event's diagnosis, as handled (a recurring incident is one record with a count: its repeats' own
    diagnoses are only seen here)."""

    def __init__(self) -> None:
        self.diagnoses: list[dict[str, Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        get_engine(trainer).bus.subscribe(EventHandled, lambda t, e: self.diagnoses.append(e.incident.diagnosis))


def _fit(tmp_path: Any, model: Any, *, raises: bool = False, monitor: Any = None, **kw: Any) -> list[dict[str, Any]]:
    events = _EveryEvent()
    callbacks = [*kw.pop("callbacks", []), monitor or GradNormMonitor(), events]
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = make_trainer(tmp_path, callbacks=callbacks, **{"max_steps": 4, **kw})
    if raises:
        with pytest.raises(NonFiniteTrainingError):
            trainer.fit(model, ckpt_path=ckpt_path)
    else:
        trainer.fit(model, ckpt_path=ckpt_path)
    records = get_engine(trainer).sink.records
    if sum(r.count for r in records) == len(events.diagnoses):
        return events.diagnoses
    return [r.diagnosis for r in records]


def _kinds(d: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in d["evidence"]]


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_overflow_names_the_layer_finite_in_float32(tmp_path: Any, precision: str) -> None:
    model = OverflowNet()
    [d] = _fit(tmp_path, model, precision=precision)
    assert d["cause"] == "half_precision_overflow"
    assert d["module"] == "power"
    assert d["where"].startswith("power: aten.mul.Tensor (forward) at ")
    assert d["where"].endswith(" in forward (finite in float32)")
    assert d["origin"]["module"] == "power"
    assert d["replayed"]
    assert d["replay_ms"] > 0
    origin = next(e for e in d["evidence"] if e["kind"] == "origin")
    assert origin["pattern"] == "half_precision_overflow"
    assert list(d["origin"]["input_dtypes"]) == ["torch.float16", "torch.float16"]
    assert 256 < origin["stats"]["max_abs_input"] < 65504  # its square overflows float16's max
    assert "replay_fp32_finite" in _kinds(d)


def test_nan_row_in_the_input_is_input_data(tmp_path: Any) -> None:
    [d] = _fit(tmp_path, RegressionNet(bad_rows=(BAD_BATCH * BATCH + 3,)))
    assert d["cause"] == "input_data"
    assert d["rows"] == [3]
    assert d["where"] == f"batch {BAD_BATCH} rows [3]"
    origin = next(e for e in d["evidence"] if e["kind"] == "origin")
    assert origin["summary"].startswith("NaN already in the step's batch: field [0] (batch rows [3]), first used by ")
    assert d["replayed"]  # traced: which field, and where it was first used
    [off] = _fit(tmp_path, RegressionNet(bad_rows=(BAD_BATCH * BATCH + 3,)), monitor=GradNormMonitor(forensics="off"))
    assert (off["cause"], off["rows"], off["where"]) == ("input_data", [3], f"batch {BAD_BATCH} rows [3]")


def test_labels_beyond_the_head_are_targets(tmp_path: Any) -> None:
    rows = (BAD_BATCH * BATCH + 1, BAD_BATCH * BATCH + 4)
    [d] = _fit(tmp_path, SoftTargetClassifier(bad_label_rows=rows))
    assert d["cause"] == "targets"
    assert d["rows"] == [1, 4]
    ev = next(e for e in d["evidence"] if e["kind"] == "targets_out_of_range")
    assert (ev["target_max"], ev["output_size"]) == (9, 5)


def test_a_saturated_sigmoid_under_a_hand_written_bce_is_a_log_of_zero(tmp_path: Any) -> None:
    [d] = _fit(tmp_path, HandBCE(hot_rows=(BAD_BATCH * BATCH + 2,)))
    assert d["cause"] == "log_of_zero"
    assert d["origin"]["op"] == "aten.log.default"
    assert d["origin"]["frame"]["code"] == "return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()"
    assert d["rows"] == [2]
    assert "binary_cross_entropy_with_logits" in d["hint"]  # the fix for a sigmoid saturated at 1.0
    assert _kinds(d) == ["origin", "counterfactual"]  # tested: without row 2 the step is finite
    assert d["replayed"]


def test_adamw_eps_underflow_in_16_true_is_optimizer_numerics(tmp_path: Any) -> None:
    model = RegressionNet(optimizer="adamw", lr=1e-3, eps=1e-8)
    [d] = _fit(tmp_path, model, raises=True, precision="16-true")  # no AutoRollback: the damage stops the run
    assert d["cause"] == "optimizer_numerics"
    assert d["state_damaged"]
    assert "grads_finite_update_not" in _kinds(d)
    assert "eps_underflow" in _kinds(d)
    assert any("eps=1e-08 is 0 in torch.float16" in e["summary"] for e in d["evidence"])
    assert d["where"].startswith("the optimizer update of ")


def test_batchnorm_statistics_poisoned_by_a_forward_are_corrupt_state(tmp_path: Any) -> None:
    [d] = _fit(tmp_path, BatchNormNet(hot_row=BAD_BATCH * BATCH + 2), raises=True)
    assert d["cause"] == "corrupt_state"
    assert "norm.running_var" in d["state_tensors"]
    assert d["where"].startswith("norm.running_var, written by the forward of norm on batch 2 rows [2]")
    assert d["rows"] == [2]
    assert "batch_magnitude" in _kinds(d)
    assert d["caused_by_data"]  # the rows that wrote the statistics: quarantine them, not only restore


def test_resumed_checkpoint_with_nan_weights_is_corrupt_state_loaded_from_file(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=1)  # ends at an epoch boundary: a clean resume
    trainer.fit(RegressionNet())
    good = str(tmp_path / "good.ckpt")
    trainer.save_checkpoint(good)
    ckpt = torch.load(good, weights_only=False)
    ckpt["state_dict"]["head.weight"][0, 0] = float("nan")
    bad = str(tmp_path / "bad.ckpt")
    torch.save(ckpt, bad)
    [d] = _fit(tmp_path, RegressionNet(), raises=True, ckpt_path=bad, max_steps=-1, max_epochs=2)
    assert d["cause"] == "corrupt_state"
    assert d["state_tensors"] == ["head.weight"]
    assert d["where"] == f"head.weight (loaded from {bad})"
    assert "state_from_checkpoint" in _kinds(d)


def test_one_off_fault_that_does_not_reproduce_is_transient(tmp_path: Any) -> None:
    [d] = _fit(tmp_path, RegressionNet(), callbacks=[FaultInjector("loss", steps=[BAD_BATCH])])
    assert d["cause"] == "transient"
    assert d["where"] == f"batch {BAD_BATCH} (not reproduced)"
    assert d["replayed"]
    assert "replay_not_reproduced" in _kinds(d)


def test_first_reuses_a_reproduced_cause_every_replays_each_off_never(tmp_path: Any) -> None:
    first = _fit(tmp_path / "first", OverflowNet(bad_batches=(1, 3)), max_steps=5, precision="16-mixed")
    assert [d["cause"] for d in first] == ["half_precision_overflow", "half_precision_overflow"]
    assert [d["replayed"] for d in first] == [True, False]
    assert "reused the replay of step 1" in first[1]["note"]
    hot = (1 * BATCH + 2, 3 * BATCH + 5)  # the same mechanism at steps 1 and 3, triggered by one record each
    # An origin that names the records triggering it is traced again while the budget allows: they are each batch's.
    again = _fit(tmp_path / "again", HandBCE(hot_rows=hot), monitor=GradNormMonitor(max_replay_steps=1e9), max_steps=5)
    # The second, fresh record meeting the same formula at the same place so soon withdraws the trigger blame
    # (policies.withdrawal): the formula is at fault, nothing is quarantined and the first record is released.
    assert [(d["cause"], d["replayed"], d["rows"]) for d in again] == [
        ("log_of_zero", True, [2]),
        ("log_of_zero", True, []),
    ]
    assert "withdrawn" in _kinds(again[1])
    # Past the budget it is reused for its cause, without the other batch's rows.
    spent = _fit(tmp_path / "spent", HandBCE(hot_rows=hot), monitor=GradNormMonitor(max_replay_steps=1e-9), max_steps=5)
    assert [(d["cause"], d["replayed"], d["rows"]) for d in spent] == [
        ("log_of_zero", True, [2]),
        ("log_of_zero", False, []),
    ]
    assert "this batch's are not known" in spent[1]["note"]
    monitor = GradNormMonitor(forensics="every", max_replay_steps=1e9)
    every = _fit(tmp_path / "every", HandBCE(hot_rows=hot), monitor=monitor, max_steps=5)
    assert [(d["cause"], d["replayed"]) for d in every] == [("log_of_zero", True)] * 2
    off = _fit(tmp_path / "off", HandBCE(hot_rows=hot), monitor=GradNormMonitor(forensics="off"), max_steps=5)
    assert [(d["cause"], d["replayed"]) for d in off] == [("unknown", False)] * 2
    assert "forensics='off'" in off[0]["note"]


def test_first_replays_again_after_a_transient(tmp_path: Any) -> None:
    # A replay that did not reproduce establishes no cause: the next event of the same kind is replayed too.
    monitor = GradNormMonitor(max_replay_steps=1e9)  # a traced replay costs several of this tiny model's steps
    ds = _fit(tmp_path, RegressionNet(), callbacks=[FaultInjector("loss", steps=[1, 3])], monitor=monitor, max_steps=5)
    assert [(d["cause"], d["replayed"]) for d in ds] == [("transient", True)] * 2


def test_gradient_accumulation_falls_back_to_cheap_evidence(tmp_path: Any) -> None:
    [d] = _fit(
        tmp_path,
        RegressionNet(),
        callbacks=[FaultInjector("loss", steps=[1])],
        accumulate_grad_batches=2,
    )
    assert not d["replayed"]
    assert "gradient accumulation" in d["note"]


def test_healthy_fit_never_replays(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_nanguard.engine.diagnose as diagnose
    import lightning_nanguard.forensics.investigation as inv

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("a healthy step was replayed")

    monkeypatch.setattr(inv, "run_pass", boom)
    monkeypatch.setattr(inv, "trace_pass", boom)
    monkeypatch.setattr(diagnose, "gather_findings", boom)
    assert _fit(tmp_path, RegressionNet(), max_steps=6) == []


class TiedHeadLM(pl.LightningModule):
    """A tiny language model with a tied head: no output Linear, the vocabulary is the embedding's size."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.tok(idx)) @ self.tok.weight.t()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        data = torch.randint(0, 50, (32, 7), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)


def test_labels_within_a_tied_head_are_not_blamed(tmp_path: Any) -> None:
    # Token labels up to 49 > the last Linear's 8 outputs: only the forward's real output size (50) may judge them.
    [d] = _fit(tmp_path, TiedHeadLM(), callbacks=[FaultInjector("loss", steps=[BAD_BATCH])])
    assert d["cause"] == "transient"


class ManualNet(RegressionNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_is_replayed_with_its_optimizer_calls_standing_in(tmp_path: Any) -> None:
    model = ManualNet()
    [d] = _fit(tmp_path, model, callbacks=[FaultInjector("grad", steps=[BAD_BATCH])])
    assert d["replayed"]  # forensics.manual: the replay steps nothing
    assert d["cause"] == "transient"  # an injected gradient NaN does not reproduce
    assert model.trainer.global_step == 4


def test_a_recurring_fp16_overflow_promotes_the_named_module(tmp_path: Any) -> None:
    from lightning_nanguard import FP32Evaluation

    model = OverflowNet(bad_batches=(1, 3))
    fp32 = FP32Evaluation(promote_after=2)
    trainer = make_trainer(tmp_path, "16-mixed", max_steps=5, callbacks=[fp32, GradNormMonitor()])
    trainer.fit(model)
    records = get_engine(trainer).sink.records
    assert [(r.cause, r.diagnosis["module"]) for r in records] == [("half_precision_overflow", "power")] * 2
    assert "promote" in records[1].actions
    assert fp32.promoted == ["power"]
