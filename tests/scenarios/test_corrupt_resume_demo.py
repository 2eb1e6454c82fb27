"""The corrupt-resume demo: its preset run falls back to the verified file and prints its summary, which names the
fallback (the demo's setup, two earlier fits, keeps Lightning's log level as it found it)."""

from __future__ import annotations

import logging
import pathlib

import pytest
from lightning_utilities.core import rank_zero

from lightning_nanguard.demo import preset, run_task

pytestmark = [
    pytest.mark.filterwarnings("ignore:CheckpointGuard:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*callbacks used to create the checkpoint.*"),
    pytest.mark.filterwarnings("ignore:(LossScaleWatchdog|FP32Evaluation):UserWarning"),
]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_corrupt_resume_demo_prints_the_summary_of_its_fallback(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank_zero_info writes to the logger of whichever Lightning package was imported last (lightning_fabric, after
    # some tests): here, as for a user of lightning.pytorch, to lightning.pytorch's.
    monkeypatch.setattr(rank_zero, "log", logging.getLogger("lightning.pytorch.utilities.rank_zero"))
    lightning_log = logging.getLogger("lightning.pytorch")
    level, records = lightning_log.level, _Records()
    lightning_log.setLevel(logging.INFO)  # Lightning's own default
    lightning_log.addHandler(records)
    try:
        result = run_task("corrupt-resume", preset(), root_dir=str(tmp_path))
        after = lightning_log.level
    finally:
        lightning_log.removeHandler(records)
        lightning_log.setLevel(level)
    assert after == logging.INFO
    assert result.finished
    assert result.actions() == [("corrupt_checkpoint", ["fallback"])]
    summaries = [m for m in records.messages if m.startswith("nanguard summary (AutoRollback")]
    assert len(summaries) == 1
    assert "corrupt_checkpoint" in summaries[0]
    assert "fallback" in summaries[0]
