"""FP32Evaluation(mode="on_nonfinite") and torchmetrics: a re-run batch leaves the module's metric states as one
float32 evaluation would (sum, mean, cat states, a MetricCollection's compute group, metrics called as forward)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import FP32Evaluation, default_callbacks
from lightning_nanguard.engine import get_engine
from tests.fp32_eval_models import HalfOverflowModel
from tests.helpers import make_trainer


class MetricModel(HalfOverflowModel):
    """HalfOverflowModel with the metrics users report: updated in the step, called as forward, in a collection."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.count = torchmetrics.SumMetric()  # samples seen: a re-run batch must count once
        self.mean_loss = torchmetrics.MeanMetric()
        self.outputs = torchmetrics.CatMetric()  # a list state
        self.mse = torchmetrics.MeanSquaredError()  # called as forward (its batch value is logged)
        # Precision and recall share one state (a compute group): the restore must keep them shared.
        self.binary = torchmetrics.MetricCollection(
            [torchmetrics.classification.BinaryPrecision(), torchmetrics.classification.BinaryRecall()]
        )
        self.results: list[dict[str, Tensor]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, scale = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y.to(out.dtype)) + 0.01 * self.penalty(out, scale).mean()
        self.eval_calls.append((batch_idx, out.dtype, float(loss.detach())))
        self.count.update(torch.ones(len(x)))
        self.mean_loss.update(loss.float())
        self.outputs.update(out.float().flatten())
        self.log("val_mse", self.mse(out.float().flatten(), y.float().flatten()))
        self.binary.update(out.float().flatten(), (y.flatten() > 0).int())
        self.log("val_loss", loss)
        return loss

    def on_validation_epoch_end(self) -> None:
        results = {
            "count": self.count.compute(),
            "mean_loss": self.mean_loss.compute(),
            "outputs": self.outputs.compute(),
            "mse": self.mse.compute(),
            **self.binary.compute(),
        }
        self.results.append({k: v.detach().clone() for k, v in results.items()})
        for metric in (self.count, self.mean_loss, self.outputs, self.mse, self.binary):
            metric.reset()


def _validate(tmp_path: Any, model: MetricModel, precision: str, callbacks: list[Any], times: int = 1) -> None:
    trainer = make_trainer(tmp_path, precision, callbacks=callbacks, limit_val_batches=None)
    for _ in range(times):
        trainer.validate(model, verbose=False)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_rerun_leaves_metrics_as_one_fp32_evaluation(tmp_path: Any, precision: str) -> None:
    model = MetricModel(bad_batches=(1, 3))
    reference = copy.deepcopy(model)
    # The reference: every batch in float32 (mode="always"); the overflowing batches' float32 values are what the
    # re-runs must contribute, and the healthy batches' half-precision values differ only by rounding.
    _validate(tmp_path / "ref", reference, precision, [FP32Evaluation("always")], times=2)
    callback = FP32Evaluation("on_nonfinite")
    _validate(tmp_path / "rerun", model, precision, [callback], times=2)  # twice: the states reset in between

    assert callback.fp32_reruns == 4
    assert [d for i, d, _ in model.eval_calls if i in (1, 3)].count(torch.float32) == 4
    for got, want in zip(model.results, reference.results, strict=True):
        assert float(got["count"]) == 32.0  # 32 samples, not 32 + 2 re-run batches of 8
        assert got["outputs"].shape == (32,)
        tol = {"rel": 2e-2, "abs": 2e-2}  # healthy batches ran in the half dtype here, in float32 there
        for name in ("mean_loss", "mse", "BinaryPrecision", "BinaryRecall"):
            assert float(got[name]) == pytest.approx(float(want[name]), **tol), name
        assert torch.allclose(got["outputs"], want["outputs"], **{"rtol": 2e-2, "atol": 2e-2})
    # The compute group's shared state stayed shared: one update still reaches both members.
    precision_metric, recall_metric = model.binary.values(copy_state=False)
    assert precision_metric.tp is recall_metric.tp


def test_healthy_batches_update_metrics_once(tmp_path: Any) -> None:
    model = MetricModel(bad_batches=())
    plain = copy.deepcopy(model)
    _validate(tmp_path / "plain", plain, "16-mixed", [])
    _validate(tmp_path / "cb", model, "16-mixed", [FP32Evaluation("on_nonfinite")])
    assert [(i, d) for i, d, _ in model.eval_calls] == [(i, torch.float16) for i in range(4)]  # nothing re-run
    for name, value in plain.results[0].items():
        assert torch.equal(model.results[0][name], value), name


def test_preset_fit_counts_each_validation_sample_once(tmp_path: Any) -> None:
    # The user's report: a SumMetric of the samples read 128 for 64 samples under the preset (16-true).
    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.count = torchmetrics.SumMetric()
            self.counts: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            out = self.net(x * 1e4) * 1e4  # overflows float16 (> 65504) for the large rows, finite in float32
            self.count.update(torch.ones(len(x)))
            self.log("val_loss", nn.functional.mse_loss(out.float() / 1e8, y))

        def on_validation_epoch_end(self) -> None:
            self.counts.append(float(self.count.compute()))
            self.count.reset()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    x, y, xv = torch.rand(64, 4), torch.zeros(64, 1), torch.rand(64, 4)
    xv[::8] *= 100.0  # a few large rows in every batch
    model = Model()
    trainer = make_trainer(
        tmp_path, "16-true", callbacks=default_callbacks(), max_steps=-1, max_epochs=2, limit_val_batches=None
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16), DataLoader(TensorDataset(xv, y), batch_size=16))
    assert model.counts == [64.0, 64.0]
    reruns = [i for i in get_engine(trainer).sink.records if i.action == "rerun"]
    # One incident per validation epoch, with the count: 4 batches each.
    assert [(i.values["count"], i.values["eval_batches"]) for i in reruns] == [(4, [0, 1, 2, 3])] * 2
