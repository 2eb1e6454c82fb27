"""The remedy policy: which installed callback does what about one event, chosen by its cause. Pure.

The ladder (docs/decides.md, "Every situation, in detail"):

=============================================  ======================================================================
cause / state                                  actions
=============================================  ======================================================================
routine GradScaler overflow (16-mixed,          ``scaler_skip``: the scaler dropped the update and lowered its scale
loss finite, state intact)
input data / targets, state intact             ``skip`` + ``quarantine`` (the data is skipped when it comes back)
input data / targets, state damaged            ``skip`` + ``quarantine`` + ``rollback``
corrupt state written by a batch's forward     ``skip`` + ``quarantine`` + ``rollback`` (e.g. BatchNorm statistics;
                                               the buffers alone are restored where nothing else is damaged: no
                                               rollback budget, the drop counts toward the dropped-updates budget)
transient, state intact                        ``skip``
corrupt state                                  ``skip`` + ``rollback``
optimizer numerics (e.g. eps underflow)        ``skip`` + ``eps_backoff`` (+ ``rollback`` if damaged)
half-precision overflow                        ``skip`` (+ ``promote`` the module once it recurred ``promote_after``
                                               times under ``*-mixed``) (+ ``rollback`` if damaged)
a spike whose probe batch's loss rose         ``rollback`` + ``backoff`` (``on_spike="probe"``; the update landed:
(weights diverging, still finite)              the rollback undoes it, passing over snapshots taken in the climb)
gradient explosion / divergence, a spike       ``skip`` + ``rollback`` + ``backoff``
(``on_spike="rollback"``), a loss-scale
collapse
a snapshot taken mid-divergence (diverging,    ``rollback`` + ``backoff`` (no update is at stake: judged at a batch
still finite)                                  start); the rollback passes over that snapshot
loss function, unknown                         ``skip`` (+ ``rollback`` if damaged)
explosion or spike skips recurring (no         ``skip`` + ``backoff`` (``skips_before_backoff`` within ``skip_window``)
rollback)
too many dropped updates in a row (not the     ``rollback`` (+ ``backoff`` where the cause's remedy lowers the LR)
data's)                                        when AutoRollback is installed, else ``stop``
too many dropped updates in the window         ``stop`` naming the cause and its fix (the data pipeline, for data);
(``max_dropped_fraction``)                     ``warn`` once and go on with ``on_dropped_budget="warn"``
state damaged and nothing can restore it       ``stop`` (the error names the tensors)
a budget ran out                               the restorative actions, then ``stop`` naming every remedy tried
=============================================  ======================================================================

The learning rate comes down only where a lower learning rate is the cause's remedy (``Remedy.lowers_lr``: a
gradient explosion, a divergence, a spike handed to AutoRollback, a loss-scale collapse). A cause the drop alone
answers (a loss formula, a transient fault, an unknown cause, a half-precision overflow) or the quarantine answers
(bad data) never lowers it, however often it recurs: its dropped updates count toward the dropped-updates budget, a
share of recent steps, and the run stops with the diagnosis once they are too many.

How far each action goes is its own policy's: ``rollback`` restores the newest snapshot not taken mid-divergence
(``policies.rollback.SnapshotJudge``), and a ``backoff`` planned with it goes one notch deeper for each snapshot it
passed over (``policies.backoff.BackoffPolicy.back_off``).

What a cause calls for is read from its declaration (``policies.causes``: the remedy family, whether the data is at
fault, the reason); the ladder above is what those declarations amount to. An action is planned only if the callback
that performs it is installed (``Installed``), so switching a callback off removes exactly its remedy. Nothing here
touches torch or Lightning: facts in, a ``Plan`` out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nanguard.contract import SPIKES, Action, Cause, Plan, Signal, StopReason
from lightning_nanguard.policies.causes import CAUSES, Remedy

__all__ = ["Installed", "RemedyFacts", "counts_as_dropped", "dropped_budget", "plan_after_step", "plan_remedy"]

_COLLAPSE_BUDGET = "the loss-scale collapse budget (LossScaleWatchdog max_collapses) ran out"


@dataclass(frozen=True)
class Installed:
    """Which remedies exist in this run (each belongs to one callback)."""

    drop: bool = False  # something drops a non-finite update (GradNormMonitor skip/stop, AutoRollback)
    quarantine: bool = False  # GradNormMonitor(quarantine=True)
    rollback: bool = False  # AutoRollback
    backoff: bool = False  # OptimizerBackoff: learning rate
    eps_backoff: bool = False  # OptimizerBackoff: eps, where the parameter dtype needs it
    promote: bool = False  # FP32Evaluation(promote_after=...)


@dataclass(frozen=True)
class RemedyFacts:
    """Everything the policy needs about one event, as plain values."""

    signal: Signal
    cause: Cause = Cause.UNKNOWN
    installed: Installed = field(default_factory=Installed)
    state_damaged: bool = False
    caused_by_data: bool = False  # the diagnosis names batch rows that caused a non-data cause (a poisoned buffer)
    # The data blame was tested and failed, or could not be tested and the records hold no NaN/inf themselves
    # (``Diagnosis.counterfactual``): nothing is quarantined.
    quarantine_withheld: bool = False
    has_update: bool = True  # a step's update is at stake (False: a snapshot check or the end-of-fit check)
    scaler_dropped: bool = False  # the GradScaler skipped this update itself (16-mixed, non-finite gradients)
    on_nonfinite: str = "skip"  # GradNormMonitor's choice: "skip" | "warn" | "stop"
    on_spike: str = "warn"  # "warn" | "skip" | "rollback" | "probe"
    on_collapse: str = "auto"  # "auto" | "warn" | "rollback" | "stop"
    skip_streak: int = 0  # consecutive non-finite steps, this one included
    max_consecutive_skips: int | None = None  # None: no such budget (GradNormMonitor not installed)
    backoff_triggers: frozenset[str] = field(
        default_factory=lambda: frozenset({"rollback", "skip", "loss_scale_collapse"})
    )
    recent_skips: int = 0  # drops of causes a lower LR answers, within OptimizerBackoff's skip_window, this one too
    skips_before_backoff: int = 3
    dropped_before: int = 0  # updates dropped within dropped_window before this one that count toward the budget
    max_dropped_fraction: float | None = None  # None: no dropped-updates budget
    dropped_window: int = 1000
    on_dropped_budget: str = "stop"  # "stop" | "warn"
    module: str = ""  # the module the diagnosis named
    module_overflows: int = 0  # half-precision overflows of that module so far, this one included
    promote_after: int | None = None
    true_half: bool = False  # *-true precision: no autocast to switch off, promotion is not possible
    # The damage is buffers a batch's forward wrote non-finite, all else sound: restoring those buffers repairs it,
    # no rollback of the parameters (AutoRollback's ``repair_buffers``; no rollback budget, the drop counts).
    repair_only: bool = False
    can_restore: bool = True  # a verified snapshot or checkpoint exists
    rollback_budget_left: int = 1  # rollbacks still allowed in the window (0: this one is the last)
    collapse_budget_left: int = 1  # LossScaleWatchdog collapses still allowed (0: stop after this one)


def plan_remedy(f: RemedyFacts) -> Plan:
    """The actions for one event, in the order they are carried out."""
    return _within_dropped_budget(f, _plan(f))


def counts_as_dropped(f: RemedyFacts, plan: Plan) -> bool:
    """Whether this event's plan drops an update that counts toward the dropped-updates budget: every drop but one a
    rollback answers (the rollback budget bounds those) and the GradScaler's routine skip (LossScaleWatchdog's)."""
    acts = plan.actions
    if f.signal is Signal.LOSS_SCALE_COLLAPSE or (Action.ROLLBACK in acts and not f.repair_only):
        return False
    if Action.SKIP in acts:
        return True
    return Action.SCALER_SKIP in acts and not CAUSES[f.cause].routine_under_scaler


def dropped_budget(fraction: float, window: int) -> int:
    """The dropped updates allowed within ``window`` steps: ``floor(fraction * window)``."""
    return int(fraction * window + 1e-9)


def _within_dropped_budget(f: RemedyFacts, plan: Plan) -> Plan:
    """Stop (or, with ``on_dropped_budget="warn"``, warn once as the budget is crossed) when this drop is one more
    than ``max_dropped_fraction`` of the last ``dropped_window`` steps allows."""
    if plan.stop is not None or f.max_dropped_fraction is None or not counts_as_dropped(f, plan):
        return plan
    allowed = dropped_budget(f.max_dropped_fraction, f.dropped_window)
    n = f.dropped_before + 1
    if n <= allowed:
        return plan
    share = f"{n} of the last {f.dropped_window} updates were dropped, more than max_dropped_fraction={f.max_dropped_fraction:g}"
    if CAUSES[f.cause].data_at_fault:
        reason = f"the data pipeline is broken: {share} (this one for bad {f.cause.value.replace('_', ' ')})"
    else:
        reason = f"{share}, for a cause no remedy of nanguard fixes ({f.cause.value.replace('_', ' ')})"
    if f.on_dropped_budget == "warn":
        if n != allowed + 1:
            return plan  # warned as the budget was crossed
        return Plan(
            (*plan.actions, Action.WARN),
            reason + "; training goes on (on_dropped_budget='warn')",
            promote_module=plan.promote_module,
        )
    return _stop(list(plan.actions), StopReason.DROPPED_BUDGET, reason, plan.promote_module)


def _plan(f: RemedyFacts) -> Plan:
    ins = f.installed
    if f.signal is Signal.LOSS_SCALE_COLLAPSE:
        return _collapse(f)
    if f.signal in SPIKES:
        return _spike(f)
    if f.signal is Signal.DIVERGING:
        return _diverging(f)
    if f.signal is Signal.PROBE_ROSE:
        return _probe_rose(f)
    drop = Action.SCALER_SKIP if f.scaler_dropped else Action.SKIP
    if not f.has_update:
        drop = Action.NONE
    elif not ins.drop and not f.scaler_dropped:
        if f.on_nonfinite == "warn":
            return Plan((Action.WARN,), 'GradNormMonitor(on_nonfinite="warn") lets the update through')
        drop = Action.NONE
    acts: list[Action] = [] if drop is Action.NONE else [drop]
    cause = CAUSES[f.cause]
    reason = cause.reason
    if (cause.data_at_fault or f.caused_by_data) and ins.quarantine and not f.quarantine_withheld:
        acts.append(Action.QUARANTINE)  # the data that did it is skipped when it comes back
    if cause.remedy is Remedy.RAISE_EPS and ins.eps_backoff:
        acts.append(Action.EPS_BACKOFF)
    elif cause.remedy is Remedy.PROMOTE_WHEN_RECURRING and _promote_due(f):
        return _with_restore(f, [*acts, Action.PROMOTE], reason, promote=f.module)
    elif cause.remedy is Remedy.ROLLBACK_AND_BACKOFF and ins.rollback:
        acts.append(Action.ROLLBACK)
        if ins.backoff and "rollback" in f.backoff_triggers:
            acts.append(Action.BACKOFF)
    # Escalation: the same trouble keeps coming back (a data cause's drops are the quarantine's: never counted).
    lowers_lr = cause.remedy.lowers_lr and ins.backoff and "skip" in f.backoff_triggers
    if f.max_consecutive_skips is not None and f.skip_streak > f.max_consecutive_skips and not cause.data_at_fault:
        too_many = (
            f"{f.skip_streak} dropped updates in a row, more than max_consecutive_skips={f.max_consecutive_skips}"
        )
        if not (ins.rollback and f.can_restore):
            return _stop(acts, StopReason.SKIP_BUDGET, too_many)
        if Action.ROLLBACK not in acts:
            acts.append(Action.ROLLBACK)
        if lowers_lr and Action.BACKOFF not in acts:
            acts.append(Action.BACKOFF)
        reason = too_many
    elif lowers_lr and f.recent_skips >= f.skips_before_backoff and Action.BACKOFF not in acts:
        acts.append(Action.BACKOFF)
    if f.on_nonfinite == "stop" and ins.drop:
        return _stop(
            acts,
            StopReason.STOP_ON_NONFINITE,
            'GradNormMonitor(on_nonfinite="stop") stops at the first non-finite step',
        )
    return _with_restore(f, acts, reason)


def plan_after_step(f: RemedyFacts) -> Plan:
    """An event seen only after someone else applied or dropped the update (DeepSpeed's ``engine.step()``): nothing
    can be dropped, undone or restored, so it is counted (the loss scaler's own skip), warned about, or ends
    training. One action, the one taken."""
    if f.signal is Signal.LOSS_SCALE_COLLAPSE:
        if f.collapse_budget_left <= 0:
            return Plan((Action.STOP,), _COLLAPSE_BUDGET, stop=StopReason.COLLAPSE_BUDGET)
        if f.on_collapse == "warn":
            return Plan((Action.WARN,), 'LossScaleWatchdog(on_collapse="warn") keeps training')
        if f.on_collapse == "stop":
            return Plan((Action.STOP,), 'LossScaleWatchdog(on_collapse="stop")', stop=StopReason.STOP_ON_COLLAPSE)
        return Plan((Action.STOP,), "no rollback can restore a good state", stop=StopReason.COLLAPSE_UNRESTORABLE)
    if f.max_consecutive_skips is not None and f.skip_streak > f.max_consecutive_skips:
        too_many = (
            f"{f.skip_streak} dropped updates in a row, more than max_consecutive_skips={f.max_consecutive_skips}"
        )
        return Plan((Action.STOP,), too_many, stop=StopReason.SKIP_BUDGET)
    return Plan((Action.SCALER_SKIP,), "the loss scaler dropped the update itself")


def _promote_due(f: RemedyFacts) -> bool:
    """The module overflowed ``promote_after`` times, and it can run in float32 (autocast to switch off)."""
    return (
        f.installed.promote
        and bool(f.module)
        and not f.true_half
        and f.promote_after is not None
        and f.module_overflows >= f.promote_after
    )


def _with_restore(f: RemedyFacts, acts: list[Action], reason: str, promote: str = "") -> Plan:
    """Add the restore a damaged state needs; stop when nothing can restore it; stop when the budget ran out."""
    remedy = CAUSES[f.cause].remedy
    if f.state_damaged or remedy is Remedy.RESTORE:
        if not f.installed.rollback:
            return _stop(
                acts,
                StopReason.NOTHING_RESTORES,
                "the state is non-finite and AutoRollback is not installed to restore it",
                promote,
            )
        if not f.can_restore:
            return _stop(
                acts,
                StopReason.NOTHING_VERIFIED,
                "the state is non-finite and no verified snapshot or checkpoint exists yet",
                promote,
            )
        if Action.ROLLBACK not in acts:
            acts.append(Action.ROLLBACK)
    if Action.ROLLBACK in acts and not f.can_restore:
        acts.remove(Action.ROLLBACK)
        if Action.BACKOFF in acts or remedy is Remedy.ROLLBACK_AND_BACKOFF:
            reason = (reason + "; " if reason else "") + "no verified snapshot or checkpoint to restore yet"
    if Action.ROLLBACK in acts and f.rollback_budget_left <= 0 and not f.repair_only:
        return _stop(
            acts,
            StopReason.ROLLBACK_BUDGET,
            "the rollback budget (AutoRollback max_rollbacks per rollback_window) ran out",
            promote,
        )
    return Plan(tuple(acts), reason, promote_module=promote)


def _stop(acts: list[Action], why: StopReason, reason: str, promote: str = "") -> Plan:
    return Plan((*acts, Action.STOP), reason, stop=why, promote_module=promote)


def _collapse(f: RemedyFacts) -> Plan:
    mode = f.on_collapse
    if mode == "auto":
        mode = "rollback" if f.installed.rollback else "stop"
    if mode == "warn":
        if f.collapse_budget_left <= 0:
            return _stop([Action.SCALER_SKIP], StopReason.COLLAPSE_BUDGET, _COLLAPSE_BUDGET)
        return Plan((Action.SCALER_SKIP, Action.WARN), 'LossScaleWatchdog(on_collapse="warn") keeps training')
    if mode == "stop":
        return _stop([Action.SCALER_SKIP], StopReason.STOP_ON_COLLAPSE, 'LossScaleWatchdog(on_collapse="stop")')
    if not f.installed.rollback:
        return _stop(
            [Action.SCALER_SKIP],
            StopReason.COLLAPSE_UNRESTORABLE,
            "no AutoRollback is installed to restore a good state",
        )
    acts = [Action.SCALER_SKIP, Action.ROLLBACK]
    if f.installed.backoff and "loss_scale_collapse" in f.backoff_triggers:
        acts.append(Action.BACKOFF)
    if f.collapse_budget_left <= 0:
        return _stop(acts, StopReason.COLLAPSE_BUDGET, _COLLAPSE_BUDGET)
    return _with_restore(f, acts, "the loss scale collapsed: the loss is exploding")


def _spike(f: RemedyFacts) -> Plan:
    if f.on_spike == "warn":
        return Plan((Action.WARN,), 'GradNormMonitor(on_spike="warn") lets the update through')
    acts = [Action.SKIP]
    if f.on_spike == "rollback" and f.installed.rollback:
        acts.append(Action.ROLLBACK)
        if f.installed.backoff and "rollback" in f.backoff_triggers:
            acts.append(Action.BACKOFF)
    elif f.installed.backoff and "skip" in f.backoff_triggers and f.recent_skips >= f.skips_before_backoff:
        acts.append(Action.BACKOFF)  # skipped spikes recurring: a lower learning rate is a spike's remedy
    if f.max_consecutive_skips is not None and f.skip_streak > f.max_consecutive_skips:
        return _stop(
            acts, StopReason.SKIP_BUDGET, f"{f.skip_streak} dropped updates in a row, more than max_consecutive_skips"
        )
    return _with_restore(f, acts, "a loss/gradient-norm spike")


def _probe_rose(f: RemedyFacts) -> Plan:
    """A spike whose probe batch's loss rose with it: the weights are going wrong, while still finite.

    The spike's update has landed (the probe scores the weights it made); the rollback undoes it with the rest of the
    climb: the newest snapshot taken before the climb began (those after it are passed over, so a backoff planned
    with it goes one notch deeper each) and a lower learning rate.
    """
    return _restore_sound_state(
        f,
        "the probe batch's loss rose",
        "the weights are going wrong: the probe batch's loss rose with the spike",
    )


def _diverging(f: RemedyFacts) -> Plan:
    """The snapshot just taken was judged taken mid-divergence: the run is diverging now, while still finite.

    As for a gradient explosion: restore a sound state (the rollback passes over the snapshot, so a backoff planned
    with it goes one notch deeper) and lower the learning rate. Nothing is dropped: no update is at stake yet.
    """
    return _restore_sound_state(
        f, "training is diverging", "training is diverging: the newest snapshot was taken mid-divergence"
    )


def _restore_sound_state(f: RemedyFacts, seen: str, why: str) -> Plan:
    """A divergence seen while everything is still finite: roll back to a sound state and, where OptimizerBackoff
    backs off at a rollback, lower the learning rate; no AutoRollback: nothing to do but say so."""
    if not f.installed.rollback:
        return Plan((), f"{seen}, and no AutoRollback is installed to restore a sound state")
    acts = [Action.ROLLBACK]
    if f.installed.backoff and "rollback" in f.backoff_triggers:
        acts.append(Action.BACKOFF)
    return _with_restore(f, acts, why)
