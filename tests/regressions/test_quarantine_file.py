"""``GradNormMonitor(quarantine_file=...)``: the file's contents are validated at construction, and its per-loader
form seeds a real fit (issue 25)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from lightning_nanguard import GradNormMonitor, NanGuardConfigError
from lightning_nanguard.engine import get_engine
from tests.helpers import make_trainer
from tests.regressions.test_quarantine_data_kinds import BAD_B, TwoLoaders


def _write(tmp_path: Any, text: str) -> str:
    path = os.path.join(tmp_path, "quarantine.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


# repro: quarantine_file_contents_not_validated.py
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"samples": "123"}', r"\"samples\" is str '123', not a list"),  # not the samples 1, 2, 3
        ("[1.5, 2.9]", r"holds \[1.5, 2.9\], not sample indices"),  # not 1 and 2
        ("[true]", r"holds \[True\], not sample indices"),  # not sample 1
        ("[-1]", r"holds \[-1\], not sample indices"),
        ('{"fingerprints": {"a": 1}}', r'"fingerprints" is dict'),
        ('{"fingerprints": ["a"]}', r"not a batch fingerprint"),
        ('{"sample": [3]}', r"unknown key\(s\) \['sample'\]"),  # a typo would quarantine nothing, silently
        ('{"loaders": {"b": [3]}, "samples": [4]}', r'"samples" lists \[4\], in none of "loaders"'),
        ("{not json", r"it is not valid JSON"),
        ("null", r"the top level is null"),
        ("42", r"the top level is int 42, not a list or an object"),
        ("[NaN]", r"NaN is not a number JSON allows"),
        ("[Infinity]", r"Infinity is not a number JSON allows"),
    ],
)
def test_a_malformed_quarantine_file_is_refused_naming_the_file_the_problem_and_the_fix(
    tmp_path: Any, text: str, problem: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(NanGuardConfigError, match=problem) as err:
        GradNormMonitor(quarantine_file=path)
    assert path in str(err.value)
    assert "Fix the file, or pass quarantine_file=None" in str(err.value)


@pytest.mark.parametrize(
    ("text", "samples"),
    [
        ("[12, 507]", [12, 507]),
        ('{"samples": [3], "fingerprints": ["0123456789abcdef"], "replaced": 4, "dropped_batches": 1}', [3]),
        ('{"samples": [3, 21], "loaders": {"*": [3], "b": [21]}}', [3, 21]),  # what a run with two loaders writes
    ],
)
def test_a_valid_quarantine_file_is_taken_as_written(tmp_path: Any, text: str, samples: list[int]) -> None:
    assert GradNormMonitor(quarantine_file=_write(tmp_path, text)).quarantined_samples == samples


def test_a_per_loader_file_keeps_that_loaders_sample_out_from_the_first_batch(tmp_path: Any) -> None:
    # The file a two-loader run wrote: b[21] only. Seeded, it is left out of loader "b" from the first batch (no
    # incident at all), while sample 21 of loader "a", healthy, is trained.
    path = _write(tmp_path, json.dumps({"samples": [BAD_B], "loaders": {"b": [BAD_B]}}))
    model = TwoLoaders()
    trainer = make_trainer(tmp_path, max_steps=-1, max_epochs=1, callbacks=[GradNormMonitor(quarantine_file=path)])
    trainer.fit(model)
    assert get_engine(trainer).sink.records == []
    a_seen = {i for batch in model.seen[0] if batch[-1] == ord("a") for i in batch[:-1]}
    b_seen = {i for batch in model.seen[0] if batch[-1] == ord("b") for i in batch[:-1]}
    assert BAD_B in a_seen
    assert BAD_B not in b_seen
