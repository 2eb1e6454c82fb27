"""GradNormMonitor's logged values on a real fit where a logging step is non-finite."""

from __future__ import annotations

import os
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_nanguard import GradNormMonitor
from lightning_nanguard.testing import FaultInjector
from tests.helpers import TinyModel, all_finite, loggers, make_trainer


@pytest.mark.parametrize("bad_steps", [[0], [0, 1, 2, 3]])
def test_histogram_leaves_out_nonfinite_norms(tmp_path: Any, bad_steps: list[int]) -> None:
    # The first logging interval holds only a non-finite step: its per-tensor norms are all NaN, and TensorBoard
    # refuses an empty histogram ("The histogram is empty"). The fit goes on; the histogram holds the finite norms.
    monitor = GradNormMonitor(histogram=True, log_every_n_steps=1, max_consecutive_skips=10)
    trainer = make_trainer(
        tmp_path, logger=loggers(tmp_path), callbacks=[monitor, FaultInjector("loss", steps=bad_steps)], max_steps=6
    )
    model = TinyModel()
    trainer.fit(model)
    assert all_finite(model)
    acc = EventAccumulator(os.path.join(tmp_path, "tb", "version_0"), size_guidance={"histograms": 0})
    acc.Reload()
    steps = [e.step for e in acc.Histograms("nanguard/grad_norm_hist")]
    assert steps == [s for s in range(6) if s not in bad_steps]
    assert monitor.skipped_steps == len(bad_steps)
