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
    # A formula that fails on valid records (its update dropped before it landed) leaves a sound state too; an exp
    # overflow, like a half-precision overflow, may come from a model growing into it.
    trusted = {Cause.INPUT_DATA, Cause.TARGETS, Cause.TRANSIENT} | (FORMULA_CAUSES - {Cause.EXP_OVERFLOW})
    assert {c for c in Cause if trusts_state(c)} == trusted
    assert trusts_state("input_data")  # the plain value, as an incident read back from its log holds it
    assert not trusts_state(None)
    assert not trusts_state("")


def test_the_data_is_at_fault_only_for_data_causes_and_the_state_is_restored_for_corrupt_state() -> None:
    assert {c for c, s in CAUSES.items() if s.data_at_fault} == {Cause.INPUT_DATA, Cause.TARGETS}
    assert {c for c, s in CAUSES.items() if s.remedy is Remedy.RESTORE} == {
        Cause.CORRUPT_STATE,
        Cause.CORRUPT_CHECKPOINT,
    }


FORMULA_CAUSES = {
    Cause.DIVISION_BY_ZERO,
    Cause.LOG_OF_ZERO,
    Cause.SQRT_AT_ZERO,
    Cause.MASKED_BRANCH_GRADIENT,
    Cause.FULLY_MASKED_SOFTMAX,
    Cause.LOW_PRECISION_ROUNDING,
    Cause.EXP_OVERFLOW,
}


def test_the_learning_rate_comes_down_only_for_a_divergence() -> None:
    # A lower learning rate is the remedy of a growing model only: a formula, bad data, a half-precision overflow, a
    # one-off or an unknown fault recurs at any learning rate (issue 24: a lower LR at each recurrence cost the run).
    divergences = {Cause.GRADIENT_EXPLOSION, Cause.WEIGHTS_DIVERGING}  # the latter measured by the probe batch
    assert {c for c, s in CAUSES.items() if s.remedy.lowers_lr} == divergences
    assert [r for r in Remedy if r.lowers_lr] == [Remedy.ROLLBACK_AND_BACKOFF]


def test_a_formula_cause_drops_the_update_and_is_bounded_never_rolled_back_or_backed_off() -> None:
    # An exp past the dtype's max is finite in float32: the module is promoted once it recurs. Every other formula
    # fails at any precision: its update is dropped (its trigger quarantined), nothing more.
    remedies = {c: CAUSES[c].remedy for c in FORMULA_CAUSES}
    assert remedies == dict.fromkeys(FORMULA_CAUSES - {Cause.EXP_OVERFLOW}, Remedy.SKIP) | {
        Cause.EXP_OVERFLOW: Remedy.PROMOTE_WHEN_RECURRING
    }
    assert not any(CAUSES[c].data_at_fault for c in FORMULA_CAUSES)
