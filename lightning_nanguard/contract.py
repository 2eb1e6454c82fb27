"""The typed contract nanguard's parts cooperate through: enums and frozen dataclasses, never strings or class names.

The five stages of one event (see ARCHITECTURE.md) pass these values along::

    sense     -> Signal          what was seen (a non-finite loss, a spike, a collapse, non-finite state)
    diagnose  -> Diagnosis       why and where: a ``Cause``, the ``Evidence`` that decided it, a hint
    decide    -> Plan            the ``Action`` s the installed callbacks will take (policies.remedy)
    act       -> Action          done: skip, quarantine, rollback, backoff, promote, stop
    report    -> Incident        one record per event, with every action taken (reporting.incidents)

Events other parts can subscribe to are frozen dataclasses too (``StateRestored``). Every value here is plain data: safe to log, to compare in tests, and to build a
policy decision from without a Trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch

__all__ = [
    "SPIKES",
    "Action",
    "Basis",
    "Cause",
    "Diagnosis",
    "Divergence",
    "Evidence",
    "EvidenceKind",
    "Notice",
    "PassedOverSnapshots",
    "Plan",
    "RestoreSource",
    "Signal",
    "StateRestored",
    "StepHealth",
    "StopReason",
]


class _Value(str, Enum):
    """A ``str`` enum whose ``str()`` and formatting give its plain value (as ``enum.StrEnum`` on Python 3.11+), so a
    record, a log line or a message built from a member reads the same as one built from its value."""

    def __str__(self) -> str:
        return str(self.value)


class Action(_Value):
    """What nanguard did about an event. A ``str`` so incident records and logs carry the plain value."""

    NONE = "none"
    WARN = "warn"
    SKIP = "skip"  # the update was dropped by nanguard (grads set to None, or the device flag the optimizer reads)
    SCALER_SKIP = "scaler_skip"  # the GradScaler dropped the update itself; nanguard only counted it
    QUARANTINE = "quarantine"  # the data that caused it is skipped from now on
    ROLLBACK = "rollback"  # parameters, buffers and optimizer state restored from a verified snapshot/checkpoint
    BACKOFF = "backoff"  # learning-rate backoff (and eps, where the policy says so)
    EPS_BACKOFF = "eps_backoff"  # eps raised alone (optimizer numerics)
    PROMOTE = "promote"  # a module runs in float32 from now on
    DEMOTE = "demote"  # a module the headroom forecast promoted runs in half precision again
    RERUN = "rerun"  # an evaluation batch was re-run in float32
    REFUSE = "refuse"  # a checkpoint was refused (save or load)
    FALLBACK = "fallback"  # a resume used another, verified checkpoint
    FIX = "fix"  # a preflight hazard was fixed before step 1
    PREFLIGHT = "preflight"  # a preflight finding reported (nothing changed)
    STOP = "stop"  # training stopped with an error


class Signal(_Value):
    """What the sensing stage saw (an incident's ``trigger``)."""

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRADS = "nonfinite_grads"
    NONFINITE_LOSS_AND_GRADS = "nonfinite_loss_and_grads"
    NONFINITE_ON_OTHER_RANK = "nonfinite_on_other_rank"
    NONFINITE_STATE = "nonfinite_state"  # parameters/buffers non-finite outside a step's gradients (snapshot, end)
    RANK_DIVERGENCE = "rank_divergence"  # DDP: the ranks' (replicated) parameters differ (snapshot, save, end)
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    LOSS_AND_GRAD_NORM_SPIKE = "loss_and_grad_norm_spike"
    DIVERGING = "diverging"  # the state just snapshotted was taken mid-divergence (loss and grad norm far up)
    PROBE_ROSE = "probe_rose"  # a spike, and the probe batch's loss under the current weights rose with it
    LOSS_SCALE_COLLAPSE = "loss_scale_collapse"


# The signals of a spike (finite, far from the run's statistics), as against a non-finite step or state.
SPIKES = frozenset({Signal.LOSS_SPIKE, Signal.GRAD_NORM_SPIKE, Signal.LOSS_AND_GRAD_NORM_SPIKE})


class Notice(_Value):
    """What was seen outside a training step's event (an incident's ``trigger`` where it is no ``Signal``): decided
    where it was seen, recorded through the one incident path (``engine.incidents.IncidentPath.report``)."""

    HEADROOM_FORECAST = "headroom_forecast"  # PrecisionHeadroom promoted a module before it overflows
    HEADROOM_RECOVERED = "headroom_recovered"  # and demoted it once its float32 output kept its headroom
    NONFINITE_CHECKPOINT = "nonfinite_checkpoint"  # CheckpointGuard refused a save
    CHECKPOINT_VERIFICATION_FAILED = "checkpoint_verification_failed"  # a checkpoint to load failed verification
    NONFINITE_EVAL_OUTPUT = "nonfinite_eval_output"  # FP32Evaluation re-ran batches in float32
    EPS_UNDERFLOW = "eps_underflow"  # preflight: an eps that is no normal number in the parameters' dtype
    FUSED_SCALER_CLIP = "fused_scaler_clip"  # preflight: a fused optimizer with a GradScaler and clipping
    HALF_MASTER = "half_master"  # preflight: true half parameters without a float32 master copy


class Cause(_Value):
    """Why an event happened: a closed set, each decided by documented evidence (``policies.diagnosis``)."""

    INPUT_DATA = "input_data"  # non-finite or far out-of-range values in the batch's inputs
    TARGETS = (
        "targets"  # non-finite targets, labels outside the model's output range, a head far larger than the labels
    )
    HALF_PRECISION_OVERFLOW = "half_precision_overflow"  # a module overflows in float16/bfloat16, finite in float32
    LOSS_FUNCTION = "loss_function"  # every module output finite, the loss not
    GRADIENT_EXPLOSION = "gradient_explosion"  # divergence: loss/grad norm rising, non-finite in float32 too
    OPTIMIZER_NUMERICS = "optimizer_numerics"  # finite gradients, non-finite update (e.g. Adam eps underflow)
    CORRUPT_STATE = "corrupt_state"  # parameters, buffers or optimizer state already non-finite
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"  # a checkpoint to resume from failed verification (CheckpointGuard)
    TRANSIENT = "transient"  # the replay did not reproduce it
    UNKNOWN = "unknown"
    # Decided from the origin of the first non-finite value (the op and line a traced replay names): a formula that
    # fails on some valid records, not bad data and not a diverging model.
    DIVISION_BY_ZERO = "division_by_zero"  # x / 0 (a normalisation or a mean without eps)
    LOG_OF_ZERO = "log_of_zero"  # log(0) = -inf, log(< 0) = NaN
    SQRT_AT_ZERO = "sqrt_at_zero"  # the gradient of sqrt (or a power < 1) at 0 is inf
    MASKED_BRANCH_GRADIENT = "masked_branch_gradient"  # torch.where masks a non-finite branch: its gradient is NaN
    FULLY_MASKED_SOFTMAX = "fully_masked_softmax"  # a softmax row whose every position is masked (-inf)
    LOW_PRECISION_ROUNDING = "low_precision_rounding"  # a value rounded to 1.0 (or 0) in a half dtype, then log
    EXP_OVERFLOW = "exp_overflow"  # exp of an argument past log(dtype max)
    # Decided by the probe batch re-scored at a spike: the weights got worse on data they had learned.
    WEIGHTS_DIVERGING = "weights_diverging"


class EvidenceKind(_Value):
    """The kinds of evidence a diagnosis rests on, cheapest first."""

    BATCH_NONFINITE = "batch_nonfinite"  # NaN/inf in an input tensor (rows named)
    BATCH_MAGNITUDE = "batch_magnitude"  # inputs far beyond the magnitudes seen so far
    TARGETS_NONFINITE = "targets_nonfinite"
    TARGETS_OUT_OF_RANGE = "targets_out_of_range"  # class labels >= the model's output size (or < 0)
    HEAD_OVERSIZED = "head_oversized"  # the output layer is far larger than the labels in use
    STATE_NONFINITE = "state_nonfinite"  # named parameters / buffers / optimizer tensors
    RANKS_DIVERGED = "ranks_diverged"  # named parameters whose copies differ across DDP ranks
    STATE_GROWN = "state_grown"  # parameters grown by orders of magnitude since the last sound snapshot
    COUNTERFACTUAL = "counterfactual"  # the step replayed without the blamed rows: finite or not
    WITHDRAWN = "withdrawn"  # an earlier data blame withdrawn: its quarantine did not stop the fault
    STATE_FROM_CHECKPOINT = "state_from_checkpoint"  # the state came non-finite from the resumed checkpoint
    HISTORY_RISING = "history_rising"  # loss / grad norm rising before the step
    HISTORY = "history"  # loss / grad norm over the last finite steps, not rising
    ORIGIN = "origin"  # the op (and line) that made the first non-finite value from finite inputs
    GRADS_FINITE_UPDATE_NOT = "grads_finite_update_not"  # the last update made finite state non-finite
    EPS_UNDERFLOW = "eps_underflow"  # an optimizer eps that is 0/subnormal in the parameter dtype
    LOSS_SCALE = "loss_scale"  # GradScaler overflow facts (scale, streak)
    REPLAY_FIRST_MODULE = "replay_first_module"  # the first module whose output (or gradient) is non-finite
    REPLAY_FP32_FINITE = "replay_fp32_finite"  # the same batch is finite in float32
    REPLAY_FP32_NONFINITE = "replay_fp32_nonfinite"  # ... and non-finite in float32 too
    REPLAY_LOSS_ONLY = "replay_loss_only"  # every module output finite, the loss not
    REPLAY_NOT_REPRODUCED = "replay_not_reproduced"  # the replay was finite
    REPLAY_SKIPPED = "replay_skipped"  # why no replay (accumulation, manual optimization, budget, mode)
    PROBE_LOSS = "probe_loss"  # the probe batch's loss at the last sound snapshot and under the current weights


class Basis(_Value):
    """Which kind of evidence decided a diagnosis, most certain first: a measurement outranks every heuristic."""

    ORIGIN = "measured_origin"  # the op that made the first non-finite value from finite inputs (a traced replay)
    STATE = "measured_state"  # the state itself: non-finite tensors, an update recomputed, parameters grown by orders
    SIGNAL = (
        "signal"  # the step's own signals: a spike, a loss-scale collapse, a GradScaler overflow, a diverging snapshot
    )
    REPLAY = "replay"  # the coarse replay: not reproduced, a module non-finite, finite in float32
    HEURISTIC = "heuristic"  # the batch's look: non-finite or outsized rows, class targets out of range
    HISTORY = "history"  # the recent history alone
    NONE = "none"  # nothing decided (``unknown``)


@dataclass(frozen=True)
class Evidence:
    """One finding. ``summary`` is a human sentence; ``values`` the plain numbers/names behind it."""

    kind: EvidenceKind
    summary: str
    values: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Diagnosis:
    """Why an event happened and where, with the evidence, identical on every rank.

    Attributes:
        cause: the cause class.
        where: the location in one phrase: a module path (``"model.blocks.2.attn"``), tensor names, ``"batch rows
            [5]"``, a checkpoint path; ``""`` when unknown.
        evidence: the findings, cheapest first.
        hint: what to try, for people.
        ranks: the ranks whose local evidence pointed at the cause (all ranks when not rank-specific).
        module: the first module whose output (or gradient) was non-finite in the replay, ``""`` if none.
        rows: batch rows implicated (input data / targets), on the ranks in ``ranks``.
        samples: dataset sample indices implicated, where the dataset exposes them (quarantine keys).
        state_tensors: names of non-finite parameters, buffers and optimizer tensors.
        state_damaged: parameters, buffers or optimizer state are non-finite now (a rollback is needed).
        replayed: a replay ran; ``replay_ms`` its cost and ``replay_steps`` that cost as a multiple of one step.
        note: anything a reader must know (e.g. "replay skipped: gradient accumulation").
        caused_by_data: the batch rows in ``rows`` caused the event: a data cause (``input_data``, ``targets``), or a
            cause that is not itself one but their forward produced it (non-finite BatchNorm statistics:
            ``corrupt_state``, then quarantined as well as restored; valid records that trigger a formula bug, such as
            an all-zero record meeting a norm without eps, quarantined as the trigger). Never false next to a data
            cause.
        decided_by: which kind of evidence decided the cause (``Basis``: a measurement, the replay, a heuristic, the
            history); the rule that decided declares it (``policies.causes.Rule.basis``).
        counterfactual: where data was blamed and a replay could test it, what the step did without the blamed
            rows (``{"rows": [...], "finite": bool, ...}``; ``{}`` when not tested).
        origin: the origin of the first non-finite value, as plain values (``policies.origin.Origin.to_dict()`` and
            its verdict's ``kind``, ``data_at_fault`` and ``summary``), ``{}`` when no traced replay found one.
    """

    cause: Cause
    where: str = ""
    evidence: tuple[Evidence, ...] = ()
    hint: str = ""
    ranks: tuple[int, ...] = ()
    module: str = ""
    rows: tuple[int, ...] = ()
    samples: tuple[int, ...] = ()
    state_tensors: tuple[str, ...] = ()
    state_damaged: bool = False
    replayed: bool = False
    replay_ms: float | None = None
    replay_steps: float | None = None
    note: str = ""
    caused_by_data: bool = False
    rank_rows: tuple[tuple[int, ...], ...] = ()  # the implicated rows on each rank (index = rank), under DDP
    origin: Mapping[str, object] = field(default_factory=dict)
    decided_by: Basis = Basis.NONE
    counterfactual: Mapping[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-ready values (for incident records)."""
        return {
            "cause": self.cause.value,
            "where": self.where,
            "hint": self.hint,
            "ranks": list(self.ranks),
            "module": self.module,
            "rows": list(self.rows),
            "samples": list(self.samples),
            "state_tensors": list(self.state_tensors),
            "state_damaged": self.state_damaged,
            "replayed": self.replayed,
            "replay_ms": self.replay_ms,
            "replay_steps": self.replay_steps,
            "note": self.note,
            "caused_by_data": self.caused_by_data,
            "origin": dict(self.origin),
            "decided_by": self.decided_by.value,
            "counterfactual": dict(self.counterfactual),
            "evidence": [{"kind": e.kind.value, "summary": e.summary, **dict(e.values)} for e in self.evidence],
        }


class StopReason(_Value):
    """Why a plan ends training: each maps to the error raised and to what to try (``reporting.messages``)."""

    NOTHING_RESTORES = "nothing_restores"  # the state is damaged and AutoRollback is not installed
    NOTHING_VERIFIED = "nothing_verified"  # the state is damaged and no verified snapshot or checkpoint exists yet
    RESTORE_FAILED = "restore_failed"  # the state is damaged and the rollback found nothing verified
    ROLLBACK_BUDGET = "rollback_budget"  # AutoRollback's max_rollbacks per rollback_window ran out
    SKIP_BUDGET = "skip_budget"  # more dropped updates in a row than max_consecutive_skips
    DROPPED_BUDGET = "dropped_budget"  # more dropped updates in the window than max_dropped_fraction allows
    STOP_ON_NONFINITE = "stop_on_nonfinite"  # GradNormMonitor(on_nonfinite="stop")
    COLLAPSE_BUDGET = "collapse_budget"  # LossScaleWatchdog's max_collapses ran out
    STOP_ON_COLLAPSE = "stop_on_collapse"  # LossScaleWatchdog(on_collapse="stop")
    COLLAPSE_UNRESTORABLE = "collapse_unrestorable"  # a collapse, and no AutoRollback to restore a good state


@dataclass(frozen=True)
class Plan:
    """The remedy policy's decision for one event: the actions, in order, and why.

    ``actions`` only holds actions whose callback is installed (an ablated callback's remedy is never planned).
    ``stop`` is set when the event ends training (after the restorative actions ran), saying why.
    """

    actions: tuple[Action, ...]
    reason: str = ""
    stop: StopReason | None = None
    promote_module: str = ""  # with Action.PROMOTE


class RestoreSource(_Value):
    MEMORY = "memory"
    DISK = "disk"


@dataclass(frozen=True)
class StateRestored:
    """Emitted after any restore of parameters/optimizer state (a rollback): re-apply what the restore undid."""

    from_step: int
    source: RestoreSource


@dataclass(frozen=True)
class StepHealth:
    """The engine's reading of one step (rank-reduced host floats): the gradient norm and the loss, if any."""

    grad_norm: float
    loss: float | None = None


@dataclass(frozen=True)
class Divergence:
    """A snapshot judged taken mid-divergence, with the reading of the last sound snapshot it was judged against
    (``policies.rollback.SnapshotJudge``).

    Attributes:
        step: the snapshot's step.
        health: the engine's reading of that step.
        reference_step: the last sound snapshot's step (``None`` when its step is not known).
        reference: that snapshot's reading.
        factor: how many times the reference both readings exceeded (``policies.rollback.DIVERGED_FACTOR``).
    """

    step: int
    health: StepHealth
    reference_step: int | None
    reference: StepHealth
    factor: float


@dataclass(frozen=True)
class PassedOverSnapshots:
    """Emitted on the engine's bus by a rollback that passed over snapshots taken mid-divergence.

    Each of them is a state that, restored, would have led straight back into the divergence: the recurrence the
    ladder would otherwise have paid for with one more rollback and one more learning-rate backoff. A backoff planned
    for the same event goes one notch further per snapshot passed over. Engine-decided (the verdicts come from
    rank-reduced readings), so identical on every rank.
    """

    restored_from: int
    passed_over: tuple[int, ...]


# Plain data: a record or a callback's state holding these values loads with ``torch.load(weights_only=True)``.
torch.serialization.add_safe_globals([Action, Signal, Cause, EvidenceKind, StopReason, RestoreSource])
