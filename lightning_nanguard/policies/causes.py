"""Every cause, declared once: what it means for the remedy, the state and the data, and the evidence that decides it.

A cause's facets are read by the code that needs one, never re-derived: the remedy policy (``policies.remedy``:
the remedy family, the reason, quarantine, whether a recurrence may lower the learning rate, the overflow counts),
the accounting of dropped updates (``engine.decide``: a data cause's drops never count toward the streak or the
backoff), the diagnosis (``policies.diagnosis``: the evidence rules in ``EVIDENCE`` order, the hint) and
AutoRollback's quiet period (``trusts_state``).

Adding a cause (ARCHITECTURE.md, "Add a cause"): its ``contract.Cause`` member, its ``CauseSpec`` in ``CAUSES``, its
evidence rule (a function in ``policies/rules/``) placed in ``EVIDENCE``, and its row in docs/FORENSICS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from lightning_nanguard.contract import Basis, Cause, Diagnosis
from lightning_nanguard.policies.findings import Findings
from lightning_nanguard.policies.origin import Origin, OriginVerdict, SourceFrame
from lightning_nanguard.policies.rules import history, origin, probe, replay, state, step
from lightning_nanguard.policies.rules import origin_patterns as patterns

__all__ = ["CAUSES", "EVIDENCE", "CauseSpec", "Remedy", "Rule", "Stage", "explain", "spec", "trusts_state"]


class Remedy(Enum):
    """The remedy family the policy applies to a cause (beyond dropping the update; ``policies.remedy``)."""

    SKIP = "skip"  # nothing more (quarantine follows ``data_at_fault``)
    RAISE_EPS = "raise_eps"  # raise the optimizer's eps
    PROMOTE_WHEN_RECURRING = "promote_when_recurring"  # the module runs in float32 once it recurs promote_after times
    ROLLBACK_AND_BACKOFF = "rollback_and_backoff"  # restore a sound state and lower the learning rate
    RESTORE = "restore"  # restore a sound state (the state itself is the fault)

    @property
    def lowers_lr(self) -> bool:
        """A lower learning rate is part of this remedy. Only then may the learning rate come down for the cause:
        with a rollback, after ``skips_before_backoff`` recurrences (OptimizerBackoff's ``skip`` trigger), or when a
        streak of its dropped updates escalates. A cause no lower learning rate fixes (a loss formula, a bad sample,
        a half-precision overflow, an unknown one) is bounded by the dropped-updates budget instead."""
        return self is Remedy.ROLLBACK_AND_BACKOFF


@dataclass(frozen=True)
class CauseSpec:
    """One cause's facets.

    Attributes:
        cause: the cause.
        reason: why the remedy fits, in one phrase (a ``Plan``'s reason).
        hint: what to try, for people (a ``Diagnosis``'s hint, unless its rule wrote a more specific one).
        remedy: the remedy family (``Remedy.lowers_lr``: whether the learning rate may come down for it).
        data_at_fault: the batch is to blame: quarantine it. Its dropped updates are the quarantine's to answer:
            they never count toward ``max_consecutive_skips`` or the skip backoff, only toward the dropped-updates
            budget, whose stop then says the data pipeline is broken.
        state_trusted: the model and optimizer state are trusted at once afterwards (no quiet period before the next
            snapshot: the data, or a one-off, was to blame).
        routine_under_scaler: an update of this cause the GradScaler dropped itself is its routine: it does not count
            toward the backoff (a run of them is LossScaleWatchdog's collapse, which backs off).
        counts_module_overflow: the module the diagnosis names counts one overflow toward ``promote_after``.
        diagnosed: decided by the evidence rules of ``EVIDENCE``; ``False`` for a cause the callback that saw it
            names directly (CheckpointGuard's verification of a checkpoint to resume from).
        pattern: for a cause the origin of the first non-finite value decides, the pattern it shows
            (``policies.rules.origin_patterns``: the summary, and the hint that works in the op's precision): the one
            place an origin is mapped to a cause, read by the evidence rules and by ``explain`` alike.
        example: an origin the pattern recognises (the registry's tests build an incident and its bundle from it).
    """

    cause: Cause
    reason: str
    hint: str
    remedy: Remedy = Remedy.SKIP
    data_at_fault: bool = False
    state_trusted: bool = False
    routine_under_scaler: bool = False
    counts_module_overflow: bool = False
    diagnosed: bool = True
    pattern: Callable[[Origin], OriginVerdict | None] | None = None
    example: Origin | None = None


def _example(
    op: str,
    *stats: tuple[str, float | int | str],
    phase: str = "forward",
    node: str = "",
    masked_by: str = "",
    surfaced_phase: str = "",
) -> Origin:
    """An origin made by ``op`` that one record of four meets (``CauseSpec.example``)."""
    frame = SourceFrame("model.py", 42, "training_step")
    return Origin(
        op,
        phase,
        stats=stats,
        rows=(1,),
        batch_size=4,
        frame=frame,
        node=node,
        masked_by=masked_by,
        surfaced_phase=surfaced_phase,
    )


CAUSES: dict[Cause, CauseSpec] = {
    s.cause: s
    for s in (
        CauseSpec(
            Cause.INPUT_DATA,
            "the batch's inputs are bad; the model and optimizer are not at fault",
            "check the data pipeline for these samples (NaN/inf or unnormalised values in the inputs)",
            data_at_fault=True,
            state_trusted=True,
            pattern=patterns.nonfinite_input,
            example=Origin("aten.addmm.default", "input", fields=("[0]",), rows=(1,), batch_size=4),
        ),
        CauseSpec(
            Cause.TARGETS,
            "the batch's targets are bad; the model and optimizer are not at fault",
            "the labels do not fit the model's output: check num_classes against the dataset's labels",
            data_at_fault=True,
            state_trusted=True,
        ),
        CauseSpec(
            Cause.HALF_PRECISION_OVERFLOW,
            "a module overflows in half precision",
            "the module overflows float16 but is finite in float32: run it in float32 (FP32Evaluation(promote_after="
            "...) under *-mixed), use bf16, or normalise its input",
            remedy=Remedy.PROMOTE_WHEN_RECURRING,
            routine_under_scaler=True,
            counts_module_overflow=True,
            pattern=patterns.half_precision_overflow,
            example=Origin(
                "aten.mul.Tensor",
                "forward",
                produced="inf",
                input_dtypes=("torch.float16", "torch.float16"),
                output_dtype="torch.float16",
                module="square",
                stats=(("dtype_max", 65504.0), ("max_abs_input", 300.0)),
            ),
        ),
        CauseSpec(
            Cause.LOSS_FUNCTION,
            "the loss function produced a non-finite value from finite outputs",
            "every module output is finite but the loss is not: guard the loss (clamp before log, eps in divisions, "
            "log_softmax instead of log(softmax))",
        ),
        CauseSpec(
            Cause.GRADIENT_EXPLOSION,
            "training is diverging",
            "lower the learning rate, clip gradients, warm up longer, or use a bigger batch",
            remedy=Remedy.ROLLBACK_AND_BACKOFF,
            pattern=patterns.overflow_past_float32,
            example=Origin(
                "aten.mm.default",
                "forward",
                produced="inf",
                input_dtypes=("torch.float32", "torch.float32"),
                module="blocks.3",
                stats=(("dtype_max", 3.4e38), ("max_abs_input", 1e20)),
            ),
        ),
        CauseSpec(
            Cause.WEIGHTS_DIVERGING,
            "the weights are going wrong: a spike, and the probe batch's loss rose with it",
            "lower the peak learning rate or warm up longer; clip gradients",
            remedy=Remedy.ROLLBACK_AND_BACKOFF,
        ),
        CauseSpec(
            Cause.OPTIMIZER_NUMERICS,
            "finite gradients produced a non-finite update",
            "the optimizer's update is non-finite from finite gradients: raise Adam eps to one representable in the "
            "parameter dtype (1e-4 for float16, OptimizerBackoff does it) or keep float32 master weights (*-mixed)",
            remedy=Remedy.RAISE_EPS,
        ),
        CauseSpec(
            Cause.CORRUPT_STATE,
            "the parameters, buffers or optimizer state are non-finite",
            "restore an earlier state (AutoRollback does it in memory); check what wrote the non-finite values",
            remedy=Remedy.RESTORE,
        ),
        CauseSpec(
            Cause.CORRUPT_CHECKPOINT,
            "the checkpoint to resume from failed verification",
            "resume from an earlier verified checkpoint (CheckpointGuard(fallback=True) does it); check the storage "
            "the file was written to and how the run that wrote it ended",
            remedy=Remedy.RESTORE,
            diagnosed=False,
        ),
        CauseSpec(
            Cause.TRANSIENT,
            "the fault did not reproduce",
            "the same batch on the same weights was finite: a one-off (hardware, race, injected fault)",
            state_trusted=True,
        ),
        CauseSpec(
            Cause.UNKNOWN,
            "",
            "check the data and the model at this step",
        ),
        # Decided from the origin (``policies.rules.origin``): a formula that fails on some valid records. Its update
        # is dropped, the records that trigger it are quarantined as its trigger (``Diagnosis.caused_by_data``), and
        # neither a rollback nor a lower learning rate is called for (no family that ``lowers_lr``): a recurrence is
        # bounded by the dropped-updates budget, whose stop names the formula and its fix. The update never landed, so the
        # state is trusted at once (an exp overflow excepted: like a half-precision overflow, a growing model may be it).
        CauseSpec(
            Cause.DIVISION_BY_ZERO,
            "a division by zero in the model's formula, on valid data; the model and optimizer are not at fault",
            "add eps to the denominator: F.normalize(h, dim=-1, eps=1e-6), or clamp_min the norm (a value "
            "representable in the dtype: 1e-6 in float16)",
            state_trusted=True,
            pattern=patterns.division_by_zero,
            example=_example("aten.div.Tensor", ("denominator_zeros", 1)),
        ),
        CauseSpec(
            Cause.LOG_OF_ZERO,
            "a log of zero in the model's formula; the model and optimizer are not at fault",
            "take the log of a quantity that cannot be 0 (clamp_min(torch.finfo(dtype).tiny)), or compute it from "
            "the logits (F.log_softmax, F.logsigmoid, F.binary_cross_entropy_with_logits)",
            state_trusted=True,
            pattern=patterns.log_of_zero,
            example=_example("aten.log.default", ("input_min", 0.0)),
        ),
        CauseSpec(
            Cause.SQRT_AT_ZERO,
            "the gradient of sqrt at zero in the model's formula; the model and optimizer are not at fault",
            "add eps inside the root (torch.sqrt(x + eps)), or use torch.linalg.vector_norm (its gradient at 0 is 0)",
            state_trusted=True,
            pattern=patterns.sqrt_at_zero,
            example=_example("aten.div.Tensor", phase="backward", node="SqrtBackward0"),
        ),
        CauseSpec(
            Cause.MASKED_BRANCH_GRADIENT,
            "torch.where masks a non-finite branch whose gradient is NaN; the model and optimizer are not at fault",
            "make the masked branch finite before the where: p * torch.log(p.clamp_min(tiny)), or "
            "torch.special.xlogy(p, p) for p * log(p)",
            state_trusted=True,
            pattern=patterns.masked_branch_gradient,
            example=_example("aten.log.default", masked_by="aten.where.self", surfaced_phase="backward"),
        ),
        CauseSpec(
            Cause.FULLY_MASKED_SOFTMAX,
            "a softmax row with every position masked; the model and optimizer are not at fault",
            "give every row an unmasked position, mask with torch.finfo(dtype).min instead of -inf, or zero those "
            "rows after the softmax",
            state_trusted=True,
            pattern=patterns.fully_masked_softmax,
            example=_example("aten._softmax.default", ("rows_all_neg_inf", 1)),
        ),
        CauseSpec(
            Cause.LOW_PRECISION_ROUNDING,
            "a formula unsafe in low precision (a value rounds to 1.0 or 0, then log); the model is not at fault",
            "compute the loss from the logits (F.binary_cross_entropy_with_logits, F.logsigmoid, F.log_softmax): "
            "clamping p to 1 - 1e-7 does not help in bfloat16 or float16, where it rounds to 1.0",
            state_trusted=True,
            pattern=patterns.low_precision_rounding,
            example=_example("aten.log.default", ("operand_ones", 1), ("operand_dtype", "torch.bfloat16")),
        ),
        CauseSpec(
            Cause.EXP_OVERFLOW,
            "an exp overflows its dtype in the model's formula",
            "subtract the row max before exp (torch.softmax and torch.logsumexp do), or run the op in float32",
            remedy=Remedy.PROMOTE_WHEN_RECURRING,
            routine_under_scaler=True,
            counts_module_overflow=True,
            pattern=patterns.exp_overflow,
            example=_example("aten.exp.default", ("max_arg", 120.0), ("log_max", 88.72)),
        ),
    )
}


def spec(cause: Cause) -> CauseSpec:
    return CAUSES[cause]


def trusts_state(cause: Cause | str | None) -> bool:
    """After an incident of ``cause`` the model and optimizer state are trusted at once (``CauseSpec.state_trusted``);
    not after an incident with no diagnosed cause."""
    return bool(cause) and CAUSES[Cause(cause)].state_trusted


class Stage(Enum):
    """When an evidence rule can be tried."""

    CHEAP = "cheap"  # on the cheap evidence: the state, the signal, the batch, the GradScaler, the history
    REPLAY = "replay"  # on a replay of the batch (only where one ran without raising; else skipped)
    LAST = "last"  # after both: what is left to say


@dataclass(frozen=True)
class Rule:
    """One way a cause is decided: ``decide`` returns the diagnosis, or ``None`` when its evidence is not there.
    ``basis`` is the kind of evidence it rests on (``Diagnosis.decided_by``): the rules are ranked by it, a
    measurement (the state, the origin) before any heuristic (the batch's look, the history)."""

    cause: Cause
    stage: Stage
    decide: Callable[[Findings], Diagnosis | None]
    basis: Basis


# The evidence rules in the order they are tried, first match wins, ranked by certainty (docs/FORENSICS.md has the
# table): the measured state first (non-finite, or parameters grown by orders of magnitude: a damaged state decides
# the remedy whatever else the event shows), then the step's own signals; then, where a replay ran, the measured
# origin of the first non-finite value (the op and line). The heuristics (class targets out of range, non-finite or
# outsized rows) decide only where nothing was measured: after the origin (class targets out of range come before it
# only where the origin itself names their rows), then the coarse replay (modules, float32); the history last. The
# cheap rules before the first replay rule settle an event without a replay (``policies.diagnosis.needs_replay``);
# the cheap ones after it decide when no replay ran.
_S, _O, _SIG, _R, _H, _HIS = Basis.STATE, Basis.ORIGIN, Basis.SIGNAL, Basis.REPLAY, Basis.HEURISTIC, Basis.HISTORY


def _formula(cause: Cause) -> Rule:
    """The evidence rule of a cause its origin pattern decides (``CauseSpec.pattern``)."""
    return Rule(cause, Stage.REPLAY, origin.formula(cause, CAUSES[cause].pattern), Basis.ORIGIN)


EVIDENCE: tuple[Rule, ...] = (
    Rule(Cause.CORRUPT_STATE, Stage.CHEAP, state.loaded_from_checkpoint, _S),
    Rule(Cause.OPTIMIZER_NUMERICS, Stage.CHEAP, state.optimizer_update, _S),
    Rule(Cause.CORRUPT_STATE, Stage.CHEAP, state.corrupt_state, _S),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, state.grown_state, _S),
    Rule(Cause.WEIGHTS_DIVERGING, Stage.CHEAP, probe.probe_rose, _S),  # the probe batch measures the weights
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, step.spike_or_collapse, _SIG),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, step.diverging, _SIG),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, step.scaler_overflow_climbing, _SIG),
    Rule(Cause.HALF_PRECISION_OVERFLOW, Stage.CHEAP, step.scaler_overflow, _SIG),
    Rule(Cause.INPUT_DATA, Stage.REPLAY, origin.nonfinite_input, _O),
    Rule(Cause.TARGETS, Stage.REPLAY, origin.nonfinite_target, _O),
    Rule(Cause.TARGETS, Stage.REPLAY, origin.targets_at_the_origin, _O),  # the origin names the rows out of range
    # The formula causes, each decided by the pattern its CauseSpec declares (this order settles an origin that
    # shows two: a masked branch's log is the masked branch, a log of a value rounded in bf16 the rounding).
    _formula(Cause.MASKED_BRANCH_GRADIENT),
    _formula(Cause.FULLY_MASKED_SOFTMAX),
    _formula(Cause.LOW_PRECISION_ROUNDING),
    _formula(Cause.LOG_OF_ZERO),
    _formula(Cause.SQRT_AT_ZERO),
    _formula(Cause.DIVISION_BY_ZERO),
    _formula(Cause.EXP_OVERFLOW),
    Rule(Cause.HALF_PRECISION_OVERFLOW, Stage.REPLAY, origin.half_precision_overflow, _O),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, origin.overflow_past_float32, _O),
    Rule(Cause.INPUT_DATA, Stage.CHEAP, step.nonfinite_inputs, _H),
    Rule(Cause.TARGETS, Stage.CHEAP, step.nonfinite_targets, _H),
    Rule(Cause.INPUT_DATA, Stage.CHEAP, step.outsized_inputs, _H),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, replay.finite_but_huge, _R),
    Rule(Cause.TRANSIENT, Stage.REPLAY, replay.not_reproduced, _R),
    Rule(Cause.TARGETS, Stage.CHEAP, step.targets_out_of_range, _H),  # the output size comes from a replay
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, replay.loss_of_huge_outputs, _R),
    Rule(Cause.LOSS_FUNCTION, Stage.REPLAY, replay.loss_of_finite_outputs, _R),
    Rule(Cause.HALF_PRECISION_OVERFLOW, Stage.REPLAY, replay.half_precision_module, _R),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, replay.nonfinite_in_float32, _R),
    Rule(Cause.UNKNOWN, Stage.REPLAY, replay.nonfinite_without_growth, _R),
    Rule(Cause.UNKNOWN, Stage.REPLAY, replay.no_float32_pass, _R),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.LAST, history.rising_history, _HIS),
    Rule(Cause.UNKNOWN, Stage.LAST, history.nothing_decided, Basis.NONE),
)


def explain(found: Origin | None) -> OriginVerdict:
    """What an origin means, by the registry: the pattern of the first cause (in ``EVIDENCE`` order) whose
    ``CauseSpec.pattern`` it shows; ``"nonfinite_state"`` for a value already non-finite in the state, ``"unknown"``
    for anything else (the coarse evidence then decides)."""
    if found is None:
        return OriginVerdict("unknown", False, "no origin traced", "")
    for rule in EVIDENCE:
        pattern = CAUSES[rule.cause].pattern if rule.basis is Basis.ORIGIN else None
        verdict = pattern(found) if pattern is not None else None
        if verdict is not None:
            return verdict
    at = f" at {found.frame}" if found.frame else ""
    if found.phase == "state":
        return OriginVerdict(
            "nonfinite_state",
            False,
            f"non-finite values already in {', '.join(found.fields) or 'the model state'}, first used by {found.op}{at}",
            "restore an earlier state (AutoRollback) and find what wrote these values",
        )
    return OriginVerdict("unknown", False, f"{found.op} made {found.produced} from finite inputs{at}", "", found.rows)
