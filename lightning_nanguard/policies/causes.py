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
from lightning_nanguard.policies.rules import history, origin, replay, state, step

__all__ = ["CAUSES", "EVIDENCE", "CauseSpec", "Remedy", "Rule", "Stage", "spec", "trusts_state"]


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


CAUSES: dict[Cause, CauseSpec] = {
    s.cause: s
    for s in (
        CauseSpec(
            Cause.INPUT_DATA,
            "the batch's inputs are bad; the model and optimizer are not at fault",
            "check the data pipeline for these samples (NaN/inf or unnormalised values in the inputs)",
            data_at_fault=True,
            state_trusted=True,
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
        ),
        CauseSpec(
            Cause.LOG_OF_ZERO,
            "a log of zero in the model's formula; the model and optimizer are not at fault",
            "take the log of a quantity that cannot be 0 (clamp_min(torch.finfo(dtype).tiny)), or compute it from "
            "the logits (F.log_softmax, F.logsigmoid, F.binary_cross_entropy_with_logits)",
            state_trusted=True,
        ),
        CauseSpec(
            Cause.SQRT_AT_ZERO,
            "the gradient of sqrt at zero in the model's formula; the model and optimizer are not at fault",
            "add eps inside the root (torch.sqrt(x + eps)), or use torch.linalg.vector_norm (its gradient at 0 is 0)",
            state_trusted=True,
        ),
        CauseSpec(
            Cause.MASKED_BRANCH_GRADIENT,
            "torch.where masks a non-finite branch whose gradient is NaN; the model and optimizer are not at fault",
            "make the masked branch finite before the where: p * torch.log(p.clamp_min(tiny)), or "
            "torch.special.xlogy(p, p) for p * log(p)",
            state_trusted=True,
        ),
        CauseSpec(
            Cause.FULLY_MASKED_SOFTMAX,
            "a softmax row with every position masked; the model and optimizer are not at fault",
            "give every row an unmasked position, mask with torch.finfo(dtype).min instead of -inf, or zero those "
            "rows after the softmax",
            state_trusted=True,
        ),
        CauseSpec(
            Cause.LOW_PRECISION_ROUNDING,
            "a formula unsafe in low precision (a value rounds to 1.0 or 0, then log); the model is not at fault",
            "compute the loss from the logits (F.binary_cross_entropy_with_logits, F.logsigmoid, F.log_softmax): "
            "clamping p to 1 - 1e-7 does not help in bfloat16 or float16, where it rounds to 1.0",
            state_trusted=True,
        ),
        CauseSpec(
            Cause.EXP_OVERFLOW,
            "an exp overflows its dtype in the model's formula",
            "subtract the row max before exp (torch.softmax and torch.logsumexp do), or run the op in float32",
            remedy=Remedy.PROMOTE_WHEN_RECURRING,
            routine_under_scaler=True,
            counts_module_overflow=True,
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
EVIDENCE: tuple[Rule, ...] = (
    Rule(Cause.CORRUPT_STATE, Stage.CHEAP, state.loaded_from_checkpoint, _S),
    Rule(Cause.OPTIMIZER_NUMERICS, Stage.CHEAP, state.optimizer_update, _S),
    Rule(Cause.CORRUPT_STATE, Stage.CHEAP, state.corrupt_state, _S),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, state.grown_state, _S),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, step.spike_or_collapse, _SIG),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, step.diverging, _SIG),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.CHEAP, step.scaler_overflow_climbing, _SIG),
    Rule(Cause.HALF_PRECISION_OVERFLOW, Stage.CHEAP, step.scaler_overflow, _SIG),
    Rule(Cause.INPUT_DATA, Stage.REPLAY, origin.nonfinite_input, _O),
    Rule(Cause.TARGETS, Stage.REPLAY, origin.nonfinite_target, _O),
    Rule(Cause.TARGETS, Stage.REPLAY, origin.targets_at_the_origin, _O),  # the origin names the rows out of range
    Rule(Cause.DIVISION_BY_ZERO, Stage.REPLAY, origin.division_by_zero, _O),
    Rule(Cause.LOG_OF_ZERO, Stage.REPLAY, origin.log_of_zero, _O),
    Rule(Cause.SQRT_AT_ZERO, Stage.REPLAY, origin.sqrt_at_zero, _O),
    Rule(Cause.MASKED_BRANCH_GRADIENT, Stage.REPLAY, origin.masked_branch_gradient, _O),
    Rule(Cause.FULLY_MASKED_SOFTMAX, Stage.REPLAY, origin.fully_masked_softmax, _O),
    Rule(Cause.LOW_PRECISION_ROUNDING, Stage.REPLAY, origin.low_precision_rounding, _O),
    Rule(Cause.EXP_OVERFLOW, Stage.REPLAY, origin.exp_overflow, _O),
    Rule(Cause.HALF_PRECISION_OVERFLOW, Stage.REPLAY, origin.half_precision_overflow, _O),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, origin.overflow_past_float32, _O),
    Rule(Cause.TARGETS, Stage.CHEAP, step.targets_out_of_range, _H),  # the output size comes from a replay
    Rule(Cause.INPUT_DATA, Stage.CHEAP, step.nonfinite_inputs, _H),
    Rule(Cause.TARGETS, Stage.CHEAP, step.nonfinite_targets, _H),
    Rule(Cause.INPUT_DATA, Stage.CHEAP, step.outsized_inputs, _H),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, replay.finite_but_huge, _R),
    Rule(Cause.TRANSIENT, Stage.REPLAY, replay.not_reproduced, _R),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, replay.loss_of_huge_outputs, _R),
    Rule(Cause.LOSS_FUNCTION, Stage.REPLAY, replay.loss_of_finite_outputs, _R),
    Rule(Cause.HALF_PRECISION_OVERFLOW, Stage.REPLAY, replay.half_precision_module, _R),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.REPLAY, replay.nonfinite_in_float32, _R),
    Rule(Cause.UNKNOWN, Stage.REPLAY, replay.nonfinite_without_growth, _R),
    Rule(Cause.UNKNOWN, Stage.REPLAY, replay.no_float32_pass, _R),
    Rule(Cause.GRADIENT_EXPLOSION, Stage.LAST, history.rising_history, _HIS),
    Rule(Cause.UNKNOWN, Stage.LAST, history.nothing_decided, Basis.NONE),
)
