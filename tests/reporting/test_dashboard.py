"""The TensorBoard dashboard, read back with TensorBoard's own reader: the layout, the charts' tags, the incidents."""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

import lightning_nanguard as ng
from lightning_nanguard.reporting.dashboard import LAYOUT
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, loggers, make_trainer


def _read(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


class _HalfEval(TinyModel):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.log("val_loss", loss)
        return loss


def test_the_layout_names_charts_the_run_fills_and_the_incidents_are_readable(tmp_path: Any) -> None:
    callbacks = [
        FaultInjector("input", steps=[3]),  # bad data: skipped and quarantined
        FaultInjector("param", steps=[9]),  # a damaged state: rolled back
        FaultInjector("grad", steps=[12, 13, 14]),  # repeated bad steps: the learning rate backs off
        ng.GradNormMonitor(),
        ng.AutoRollback(every_n_steps=2, quiet_steps=0, skip_batches=1),
        ng.OptimizerBackoff(),
        ng.LossScaleWatchdog(),
        ng.FP32Evaluation(mode="on_nonfinite"),
        ng.PrecisionHeadroom(every_n_steps=4),
    ]
    trainer = make_trainer(
        tmp_path,
        "16-mixed",
        logger=loggers(tmp_path),
        max_steps=18,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        val_check_interval=8,
        callbacks=callbacks,
    )
    trainer.fit(_HalfEval())
    acc = _read(os.path.join(tmp_path, "tb", "version_0"))
    tags = acc.Tags()

    # The layout, as TensorBoard's custom-scalars plugin stores and parses it.
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    got = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    assert got == {cat: {title: chart[1] for title, chart in charts.items()} for cat, charts in LAYOUT.items()}

    # Every chart draws something in a run where its callback acted.
    scalars = tags["scalars"]
    for category in layout.category:
        for chart in category.chart:
            for pattern in chart.multiline.tag:
                assert any(re.fullmatch(pattern, t) for t in scalars), (category.title, chart.title, pattern)

    # Incident markers at their own steps, and the incident text as Markdown with cause and location.
    markers = {t: [e.step for e in acc.Scalars(t)] for t in scalars if t.startswith("nanguard/incident/")}
    assert 3 in markers["nanguard/incident/quarantine"]
    assert 9 in markers["nanguard/incident/rollback"]
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("nanguard/incidents/text_summary")]
    assert any("cause: **input_data**" in t and "rows" in t for t in texts)
    assert any("cause: **corrupt_state**" in t and "body.0.weight" in t for t in texts)
