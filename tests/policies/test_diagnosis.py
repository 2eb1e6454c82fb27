"""``policies.diagnosis.classify`` on recorded evidence: no Trainer, no tensors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_nanguard.contract import Cause, EvidenceKind, Signal
from lightning_nanguard.policies.diagnosis import classify, needs_replay, replay_steps, signature
from lightning_nanguard.policies.findings import Findings, PassResult, ReplayFindings
from lightning_nanguard.policies.origin import Origin, SourceFrame
from lightning_nanguard.signals.batch import BatchFindings
from lightning_nanguard.signals.history import HistoryFindings, read_history
from lightning_nanguard.signals.state import StateFindings

BAD = Signal.NONFINITE_LOSS_AND_GRADS


def _replay(hooked: PassResult, fp32: PassResult | None = None) -> ReplayFindings:
    return ReplayFindings(hooked=hooked, fp32=fp32, ms=1.0)


OVERFLOW = PassResult(
    reproduced=True,
    loss_finite=False,
    outputs_finite=False,
    grads_finite=False,
    first_module="blocks.2.attn",
    first_kind="output",
    input_min=-900.0,
    input_max=1200.0,
    dtype="torch.float16",
)
FINITE = PassResult()


def test_checkpoint_state_names_the_file() -> None:
    f = Findings(BAD, state_ok=False, state=StateFindings(parameters=("head.weight",)), resumed_from="/ck/last.ckpt")
    d = classify(f)
    assert d.cause is Cause.CORRUPT_STATE
    assert d.where == "head.weight (loaded from /ck/last.ckpt)"
    assert d.state_damaged
    assert [e.kind for e in d.evidence] == [EvidenceKind.STATE_NONFINITE, EvidenceKind.STATE_FROM_CHECKPOINT]


def test_finite_step_then_nonfinite_adam_update_is_optimizer_numerics() -> None:
    state = StateFindings(parameters=("w",), update_nonfinite=("w",), eps_underflow=("eps=1e-08 is 0",))
    d = classify(Findings(BAD, state_ok=False, state=state, last_step_finite=True, finite_steps=3))
    assert d.cause is Cause.OPTIMIZER_NUMERICS
    assert d.where == "the optimizer update of w"
    assert EvidenceKind.GRADS_FINITE_UPDATE_NOT in [e.kind for e in d.evidence]


def test_damaged_state_without_a_finite_step_before_is_corrupt_state() -> None:
    state = StateFindings(parameters=("w",), update_nonfinite=("w",))
    assert classify(Findings(BAD, state_ok=False, state=state, finite_steps=3)).cause is Cause.CORRUPT_STATE


def test_buffers_name_their_module_and_the_batch_rows_that_wrote_them() -> None:
    state = StateFindings(buffers=("bn.running_var",), buffer_modules=("bn",))
    batch = (BatchFindings(magnitude_rows=(4,), max_abs=1e20, median_row_abs=1.0),)
    d = classify(Findings(BAD, state_ok=False, state=state, batch=batch, batch_idx=7, finite_steps=7))
    assert d.cause is Cause.CORRUPT_STATE
    assert d.where == "bn.running_var, written by the forward of bn on batch 7 rows [4]"
    assert d.rows == (4,)


def test_nonfinite_rows_name_the_rank_under_ddp() -> None:
    batch = (BatchFindings(), BatchFindings(nonfinite_rows=(2, 5)))
    d = classify(Findings(BAD, ranks=(1,), batch=batch, batch_idx=3))
    assert d.cause is Cause.INPUT_DATA
    assert (d.ranks, d.rows, d.where) == ((1,), (2, 5), "rank 1 batch 3 rows [2, 5]")
    assert needs_replay(Findings(BAD, batch=batch))  # the origin first: where the NaN went, and from which field


def test_labels_outside_the_head_are_targets() -> None:
    batch = (BatchFindings(target_rows=(0,), target_min=0, target_max=999, output_size=10),)
    d = classify(Findings(BAD, batch=batch, batch_idx=0))
    assert d.cause is Cause.TARGETS
    assert "the model has 10 outputs" in d.evidence[0].summary


def test_spike_and_collapse_are_explosions() -> None:
    history = read_history([(i, 2.0**i, 1.0) for i in range(6)])
    assert history.grad_norm_rising
    for signal in (Signal.GRAD_NORM_SPIKE, Signal.LOSS_SCALE_COLLAPSE):
        d = classify(Findings(signal, history=history))
        assert d.cause is Cause.GRADIENT_EXPLOSION
        assert "(rising)" in d.evidence[0].summary


def test_routine_scaler_overflow_needs_no_replay() -> None:
    f = Findings(Signal.NONFINITE_GRADS, scaler_overflow=True, scale=65536.0, half_precision=True)
    assert not needs_replay(f)
    assert classify(f).where == "gradients at loss scale 65536"


def test_replay_verdicts() -> None:
    base = Findings(BAD, batch=(BatchFindings(),), batch_idx=4, half_precision=True, precision="16-mixed")
    assert needs_replay(base)

    rising = read_history([(i, 2.0**i, 1.0) for i in range(6)])

    def cause(*replays: ReplayFindings, half: bool = True, growing: bool = True) -> tuple[Cause, str]:
        history = rising if growing else HistoryFindings()
        d = classify(Findings(**{**base.__dict__, "replay": replays, "half_precision": half, "history": history}))
        return d.cause, d.where

    assert cause(_replay(FINITE)) == (Cause.TRANSIENT, "batch 4 (not reproduced)")
    loss_only = PassResult(reproduced=True, loss_finite=False, grads_finite=False)
    assert cause(_replay(loss_only))[0] is Cause.LOSS_FUNCTION
    assert cause(_replay(OVERFLOW, FINITE)) == (Cause.HALF_PRECISION_OVERFLOW, "blocks.2.attn (finite in float32)")
    assert cause(_replay(OVERFLOW, OVERFLOW)) == (
        Cause.GRADIENT_EXPLOSION,
        "blocks.2.attn (non-finite in float32 too)",
    )
    assert cause(_replay(OVERFLOW), half=False) == (Cause.GRADIENT_EXPLOSION, "blocks.2.attn (non-finite in 16-mixed)")
    # An explosion needs evidence of growth: with a flat history and no huge value, non-finite in float32 is unknown.
    assert cause(_replay(OVERFLOW, OVERFLOW), growing=False) == (
        Cause.UNKNOWN,
        "blocks.2.attn (non-finite in float32 too)",
    )
    assert cause(_replay(OVERFLOW), half=False, growing=False)[0] is Cause.UNKNOWN
    huge = PassResult(**{**OVERFLOW.__dict__, "max_abs_output": 1e30})
    assert cause(_replay(huge), half=False, growing=False)[0] is Cause.GRADIENT_EXPLOSION
    assert cause(_replay(OVERFLOW))[0] is Cause.UNKNOWN  # half precision, no float32 pass: the module only
    # Two ranks, the fault on rank 1 only: named, and the verdict is the same whoever computes it.
    assert cause(_replay(FINITE, FINITE), _replay(OVERFLOW, FINITE)) == (
        Cause.HALF_PRECISION_OVERFLOW,
        "blocks.2.attn on rank 1 (finite in float32)",
    )


def test_a_replay_that_raised_falls_back_and_says_so() -> None:
    f = Findings(BAD, batch=(BatchFindings(),), replay=(_replay(PassResult(error="RuntimeError: boom")),))
    d = classify(f)
    assert d.cause is Cause.UNKNOWN
    assert "replay failed: RuntimeError: boom" in d.note


def test_no_replay_rising_history_is_an_explosion_else_unknown_with_the_reason() -> None:
    rising = read_history([(i, 10.0**i, None) for i in range(5)])
    assert classify(Findings(BAD, history=rising)).cause is Cause.GRADIENT_EXPLOSION
    d = classify(Findings(BAD, history=HistoryFindings(), note="replay skipped (manual optimization)"))
    assert d.cause is Cause.UNKNOWN
    assert d.evidence[0].kind is EvidenceKind.REPLAY_SKIPPED
    assert d.note == "replay skipped (manual optimization)"


def test_signature_depends_on_rank_consistent_evidence_only() -> None:
    a = Findings(BAD, batch=(BatchFindings(nonfinite_rows=(1,)),), batch_idx=1)
    b = Findings(BAD, batch=(BatchFindings(nonfinite_rows=(6,)),), batch_idx=9)
    c = Findings(BAD, batch=(BatchFindings(),))
    assert signature(a) == signature(b) != signature(c)


def test_diagnosis_is_json_ready_and_costed() -> None:
    f = Findings(
        BAD,
        batch=(BatchFindings(),),
        replay=(_replay(OVERFLOW, FINITE),),
        half_precision=True,
        replayed_now=True,
        replay_ms=12.5,
        replay_steps=replay_steps(12.5, 0.005),
    )
    d = classify(f)
    assert d.replayed
    assert d.replay_ms == 12.5
    assert d.replay_steps == pytest.approx(2.5)
    json.dumps(d.to_dict())
    assert replay_steps(1.0, float("nan")) is None


def test_a_head_far_larger_than_the_labels_is_context_not_a_cause() -> None:
    batch = (BatchFindings(target_min=0, target_max=9),)
    replay = (_replay(PassResult(reproduced=True, loss_finite=False, grads_finite=False)),)
    d = classify(Findings(BAD, batch=batch, replay=replay, output_size=1000))
    assert d.cause is Cause.LOSS_FUNCTION  # decided by the replay; the head is context
    assert d.evidence[-1].kind is EvidenceKind.HEAD_OVERSIZED
    assert "1000 outputs and the batch's labels use at most 10" in d.hint
    assert EvidenceKind.HEAD_OVERSIZED not in [
        e.kind for e in classify(Findings(BAD, batch=batch, replay=replay, output_size=50)).evidence
    ]


def test_finite_but_huge_outputs_with_a_nonfinite_loss_are_divergence_not_the_loss() -> None:
    huge = PassResult(
        reproduced=True, loss_finite=False, grads_finite=False, max_abs_output=3e20, max_abs_module="head"
    )
    d = classify(Findings(BAD, batch=(BatchFindings(),), replay=(_replay(huge),)))
    assert d.cause is Cause.GRADIENT_EXPLOSION
    assert d.where == "head (outputs up to 3e+20: the loss overflowed from their size)"
    small = PassResult(reproduced=True, loss_finite=False, grads_finite=False, max_abs_output=1.0)
    assert classify(Findings(BAD, batch=(BatchFindings(),), replay=(_replay(small),))).cause is Cause.LOSS_FUNCTION


def test_scaler_overflows_into_a_climbing_loss_are_an_explosion() -> None:
    climbing = read_history([(i, 1.0, 0.5 * 2.0**i) for i in range(6)])
    assert climbing.loss_rising
    f = Findings(Signal.NONFINITE_GRADS, scaler_overflow=True, scale=1024.0, history=climbing)
    d = classify(f)
    assert d.cause is Cause.GRADIENT_EXPLOSION
    assert d.where == "gradients at loss scale 1024, the loss climbing"
    assert "loss 0.5, 1, 2, 4, 8, 16 (rising)" in d.evidence[0].summary


def test_a_finite_replay_with_huge_gradients_is_divergence_not_transient() -> None:
    huge = PassResult(max_abs_grad=4e20, max_abs_output=1e3, max_abs_module="net.4")
    d = classify(Findings(Signal.NONFINITE_GRADS, batch=(BatchFindings(),), replay=(_replay(huge),)))
    assert d.cause is Cause.GRADIENT_EXPLOSION
    assert d.where.startswith("net.4 (finite but huge: gradients up to 4e+20")


# ---------------------------------------------------------------- the origin decides first (policies/rules/origin.py)
NORM = Origin(
    "aten.div.Tensor",
    "forward",
    frame=SourceFrame("model.py", 71, "training_step", "h = h / h.norm(dim=-1, keepdim=True)"),
    stats=(("denominator_zeros", 1), ("denominator_producer", "aten.linalg_vector_norm.default")),
    rows=(1,),
    batch_size=4,
)
TRACED = PassResult(reproduced=True, loss_finite=False, outputs_finite=False, grads_finite=False, first_module="head")


def _traced(origin: Origin | None, **kw: object) -> ReplayFindings:
    return _replay(PassResult(**{**TRACED.__dict__, "origin": origin, **kw}))  # type: ignore[arg-type]


def test_the_origin_decides_before_the_coarse_replay_and_names_its_trigger() -> None:
    d = classify(Findings(BAD, batch=(BatchFindings(),), batch_idx=2, replay=(_traced(NORM),)))
    assert d.cause is Cause.DIVISION_BY_ZERO  # the coarse replay alone: an explosion "non-finite in 32-true"
    assert d.where == "aten.div.Tensor (forward) at model.py:71 in training_step, batch 2 rows [1]"
    assert (d.rows, d.caused_by_data, d.state_damaged) == ((1,), True, False)
    assert d.evidence[0].kind is EvidenceKind.ORIGIN
    assert d.origin["op"] == "aten.div.Tensor"
    assert "F.normalize" in d.hint
    assert "the data is valid" in d.note


def test_every_row_meeting_the_formula_quarantines_nothing() -> None:
    whole = dataclasses.replace(NORM, rows=(0, 1, 2, 3))
    d = classify(Findings(BAD, batch=(BatchFindings(),), batch_idx=2, replay=(_traced(whole),)))
    assert d.cause is Cause.DIVISION_BY_ZERO
    assert (d.rows, d.caused_by_data) == ((), False)
    assert "nothing is quarantined" in d.note


def test_a_trigger_is_quarantined_on_its_own_rank_only() -> None:
    d = classify(Findings(BAD, batch=(BatchFindings(), BatchFindings()), replay=(_traced(None), _traced(NORM))))
    assert d.cause is Cause.DIVISION_BY_ZERO
    assert (d.ranks, d.rows, d.rank_rows) == ((1,), (1,), ((), (1,)))
    assert d.origin["rank"] == 1


def test_an_input_origin_is_the_data_or_the_targets_by_the_batch_evidence() -> None:
    nan = Origin("aten.addmm.default", "input", fields=("[0]",), rows=(3,), batch_size=8)
    inputs = classify(Findings(BAD, batch=(BatchFindings(nonfinite_rows=(3,)),), replay=(_traced(nan),)))
    assert (inputs.cause, inputs.rows) == (Cause.INPUT_DATA, (3,))
    assert [e.kind for e in inputs.evidence] == [EvidenceKind.BATCH_NONFINITE, EvidenceKind.ORIGIN]
    target = Origin("aten.mse_loss.default", "input", fields=("[1]",), rows=(3,), batch_size=8)
    targets = classify(Findings(BAD, batch=(BatchFindings(nonfinite_target_rows=(3,)),), replay=(_traced(target),)))
    assert (targets.cause, targets.rows) == (Cause.TARGETS, (3,))


def test_a_half_precision_overflow_without_a_float32_pass_is_judged_from_the_op_inputs() -> None:
    def overflow(biggest: float) -> Origin:
        stats = (("dtype_max", 65504.0), ("max_abs_input", biggest))
        return Origin("aten.mul.Tensor", "forward", input_dtypes=("torch.float16",), module="square", stats=stats)

    f = Findings(BAD, batch=(BatchFindings(),), half_precision=True, precision="16-true")
    d = classify(Findings(**{**f.__dict__, "replay": (_traced(overflow(1900.0)),)}))
    assert (d.cause, d.module) == (Cause.HALF_PRECISION_OVERFLOW, "square")
    assert d.evidence[1].kind is EvidenceKind.REPLAY_FP32_FINITE
    assert classify(Findings(**{**f.__dict__, "replay": (_traced(overflow(1e30)),)})).cause is Cause.UNKNOWN


def test_the_growth_an_explosion_needs_and_the_history_it_names() -> None:
    past_float32 = Origin("aten.mm.default", "forward", input_dtypes=("torch.float32",), stats=(("dtype_max", 3.4e38),))
    assert classify(Findings(BAD, batch=(BatchFindings(),), replay=(_traced(past_float32),))).cause is (
        Cause.GRADIENT_EXPLOSION
    )
    flat = read_history([(i, 12.0 + (i % 2), 0.5) for i in range(8)])
    d = classify(Findings(BAD, batch=(BatchFindings(),), history=flat, replay=(_traced(None),)))
    assert d.cause is Cause.UNKNOWN  # non-finite in 32-true, a flat grad norm of 12-13: no explosion
    assert "no sign of growth" in d.note
    assert d.evidence[-1].kind is EvidenceKind.HISTORY  # not history_rising


def test_a_history_is_rising_from_its_level_not_from_one_small_early_value() -> None:
    warm_up = read_history([(0, 2.0, None), (1, 12.1, None), (2, 12.0, None), (3, 12.3, None), (4, 12.6, None)])
    assert not warm_up.grad_norm_rising  # a first small norm, then flat at 12-13
    dip = read_history([(i, 1.0, 0.02) for i in range(5)] + [(5, 1.0, 0.002), (6, 1.0, 0.004), (7, 1.0, 0.006)])
    assert not dip.loss_rising  # a dip that comes back up below its level
    climb = read_history([(i, 1.0, None) for i in range(4)] + [(4, 2.0, None), (5, 5.0, None), (6, 20.0, None)])
    assert climb.grad_norm_rising
