"""``reporting.emit.log_event``: one TensorBoard event per logging step, the same scalars ``log_metrics`` writes."""

from __future__ import annotations

import glob
import math
from types import SimpleNamespace
from typing import Any

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from lightning_nanguard.reporting import emit
from tests.helpers import csv_metrics, tb_scalars

METRICS = {"nanguard/grad_norm": 0.25, "nanguard/loss": math.inf, "nanguard/skipped_steps": 3.0}


def _events(log_dir: str) -> list[Any]:
    (path,) = glob.glob(f"{log_dir}/events.out.tfevents.*")
    return [e for e in EventFileLoader(path).Load() if e.HasField("summary")]


def _log(*loggers: Any, step: int = 7) -> None:
    emit.log_event(SimpleNamespace(loggers=list(loggers)), METRICS, step=step)  # type: ignore[arg-type]
    for logger in loggers:
        logger.save()
        logger.finalize("success")


def test_a_tensorboard_logger_gets_every_scalar_in_one_event(tmp_path: Any) -> None:
    tb = TensorBoardLogger(str(tmp_path), name="tb", default_hp_metric=False)
    csv = CSVLogger(str(tmp_path), name="csv")
    _log(tb, csv)
    events = _events(tb.log_dir)
    assert [e.step for e in events] == [7]
    assert tb_scalars(tb.log_dir) == {k: [(7, v)] for k, v in METRICS.items()}
    (row,) = csv_metrics(csv.log_dir)  # every other logger: log_metrics, unchanged
    assert {k: float(row[k]) for k in METRICS} == METRICS
    assert row["step"] == "7"


def test_a_prefix_or_an_overridden_log_metrics_goes_through_log_metrics(tmp_path: Any) -> None:
    prefixed = TensorBoardLogger(str(tmp_path), name="prefixed", prefix="run", default_hp_metric=False)
    _log(prefixed)
    assert sorted(tb_scalars(prefixed.log_dir)) == sorted(f"run-{k}" for k in METRICS)
    assert len(_events(prefixed.log_dir)) == len(METRICS)  # one per key: Lightning's own path

    seen: list[dict[str, float]] = []

    class Custom(TensorBoardLogger):
        def log_metrics(self, metrics: Any, step: Any = None) -> None:
            seen.append(dict(metrics))
            super().log_metrics(metrics, step)

    _log(Custom(str(tmp_path), name="custom", default_hp_metric=False))
    assert seen == [METRICS]
