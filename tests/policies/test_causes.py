"""Every cause is one declaration (``policies/causes.py``): a spec, an evidence rule, and a documented row."""

from __future__ import annotations

import os

from lightning_nanguard.contract import Cause, Signal
from lightning_nanguard.policies.causes import CAUSES, EVIDENCE, Remedy, Stage, trusts_state
from lightning_nanguard.policies.findings import Findings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_cause_has_a_spec_and_an_evidence_rule() -> None:
    assert set(CAUSES) == set(Cause)
    assert all(spec.cause is cause for cause, spec in CAUSES.items())
    assert {rule.cause for rule in EVIDENCE} == {c for c in Cause if CAUSES[c].diagnosed}


def test_every_cause_has_a_row_in_the_forensics_table() -> None:
    with open(os.path.join(ROOT, "docs", "FORENSICS.md"), encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("| `")]
    missing = [c.value for c in Cause if not any(row.startswith(f"| `{c.value}`") for row in rows)]
    assert not missing, f"docs/FORENSICS.md has no row for {missing}"


def test_the_last_rule_always_decides() -> None:
    last = EVIDENCE[-1]
    assert last.stage is Stage.LAST
    assert last.decide(Findings(Signal.NONFINITE_LOSS)) is not None


def test_the_state_is_trusted_again_only_where_the_data_or_a_one_off_was_to_blame() -> None:
    # AutoRollback skips its quiet period after these, and only these: the model and optimizer were not at fault.
    assert {c for c in Cause if trusts_state(c)} == {Cause.INPUT_DATA, Cause.TARGETS, Cause.TRANSIENT}
    assert trusts_state("input_data")  # the plain value, as an incident read back from its log holds it
    assert not trusts_state(None)
    assert not trusts_state("")


def test_the_data_is_at_fault_only_for_data_causes_and_the_state_is_restored_for_corrupt_state() -> None:
    assert {c for c, s in CAUSES.items() if s.data_at_fault} == {Cause.INPUT_DATA, Cause.TARGETS}
    assert {c for c, s in CAUSES.items() if s.remedy is Remedy.RESTORE} == {
        Cause.CORRUPT_STATE,
        Cause.CORRUPT_CHECKPOINT,
    }
