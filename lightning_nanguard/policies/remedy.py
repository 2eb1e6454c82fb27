"""The remedy policy: which installed callback does what about one event, chosen by its cause. Pure.

The ladder (README, "What happens when"):

=============================================  ======================================================================
cause / state                                  actions
=============================================  ======================================================================
routine GradScaler overflow (16-mixed,          ``scaler_skip``: the scaler dropped the update and lowered its scale
loss finite, state intact)
input data / targets, state intact             ``skip`` + ``quarantine`` (the data is skipped when it comes back)
input data / targets, state damaged            ``skip`` + ``quarantine`` + ``rollback``
corrupt state written by a batch's forward     ``skip`` + ``quarantine`` + ``rollback`` (e.g. BatchNorm statistics)
transient, state intact                        ``skip``
corrupt state                                  ``skip`` + ``rollback``
optimizer numerics (e.g. eps underflow)        ``skip`` + ``eps_backoff`` (+ ``rollback`` if damaged)
half-precision overflow                        ``skip`` (+ ``promote`` the module once it recurred ``promote_after``
                                               times under ``*-mixed``) (+ ``rollback`` if damaged)
gradient explosion / divergence, a spike       ``skip`` + ``rollback`` + ``backoff``
(``on_spike="rollback"``), a loss-scale
collapse
a snapshot taken mid-divergence (diverging,    ``rollback`` + ``backoff`` (no update is at stake: judged at a batch
still finite)                                  start); the rollback passes over that snapshot
loss function, unknown                         ``skip`` (+ ``rollback`` if damaged)
too many dropped updates in a row              ``rollback`` + ``backoff`` when AutoRollback is installed, else ``stop``
state damaged and nothing can restore it       ``stop`` (the error names the tensors)
a budget ran out                               the restorative actions, then ``stop`` naming every remedy tried
=============================================  ======================================================================

How far each action goes is its own policy's: ``rollback`` restores the newest snapshot not taken mid-divergence
(``policies.rollback.SnapshotJudge``), and a ``backoff`` planned with it goes one notch deeper for each snapshot it
passed over (``policies.backoff.BackoffPolicy.back_off``).

An action is planned only if the callback that performs it is installed (``Installed``), so switching a callback off
removes exactly its remedy. Nothing here touches torch or Lightning: facts in, a ``Plan`` out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_nanguard.contract import Action, Cause, Plan, Signal

__all__ = ["Installed", "RemedyFacts", "plan_remedy"]

_SPIKES = (Signal.LOSS_SPIKE, Signal.GRAD_NORM_SPIKE, Signal.LOSS_AND_GRAD_NORM_SPIKE)


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
    cause: Cause
    installed: Installed
    state_damaged: bool = False
    caused_by_data: bool = False  # the diagnosis names batch rows that caused a non-data cause (a poisoned buffer)
    has_update: bool = True  # a step's update is at stake (False: a snapshot check or the end-of-fit check)
    scaler_dropped: bool = False  # the GradScaler skipped this update itself (16-mixed, non-finite gradients)
    on_nonfinite: str = "skip"  # GradNormMonitor's choice: "skip" | "warn" | "stop"
    on_spike: str = "warn"  # "warn" | "skip" | "rollback"
    on_collapse: str = "auto"  # "auto" | "warn" | "rollback" | "stop"
    skip_streak: int = 0  # consecutive non-finite steps, this one included
    max_consecutive_skips: int | None = None  # None: no such budget (GradNormMonitor not installed)
    backoff_triggers: frozenset[str] = field(
        default_factory=lambda: frozenset({"rollback", "skip", "loss_scale_collapse"})
    )
    recent_skips: int = 0  # non-data dropped updates within OptimizerBackoff's skip_window, this one included
    skips_before_backoff: int = 3
    module: str = ""  # the module the diagnosis named
    module_overflows: int = 0  # half-precision overflows of that module so far, this one included
    promote_after: int | None = None
    true_half: bool = False  # *-true precision: no autocast to switch off, promotion is not possible
    can_restore: bool = True  # a verified snapshot or checkpoint exists
    rollback_budget_left: int = 1  # rollbacks still allowed in the window (0: this one is the last)
    collapse_budget_left: int = 1  # LossScaleWatchdog collapses still allowed (0: stop after this one)


def plan_remedy(f: RemedyFacts) -> Plan:
    """The actions for one event, in the order they are carried out."""
    ins = f.installed
    if f.signal is Signal.LOSS_SCALE_COLLAPSE:
        return _collapse(f)
    if f.signal in _SPIKES:
        return _spike(f)
    if f.signal is Signal.DIVERGING:
        return _diverging(f)
    drop = Action.SCALER_SKIP if f.scaler_dropped else Action.SKIP
    if not f.has_update:
        drop = Action.NONE
    elif not ins.drop and not f.scaler_dropped:
        if f.on_nonfinite == "warn":
            return Plan((Action.WARN,), 'GradNormMonitor(on_nonfinite="warn") lets the update through')
        drop = Action.NONE
    acts: list[Action] = [] if drop is Action.NONE else [drop]
    reason = _CAUSE_REASONS.get(f.cause, "")
    cause = f.cause
    if (cause.data_caused or f.caused_by_data) and ins.quarantine:
        acts.append(Action.QUARANTINE)  # the data that did it is skipped when it comes back
    if cause.data_caused:
        pass
    elif cause is Cause.OPTIMIZER_NUMERICS:
        if ins.eps_backoff:
            acts.append(Action.EPS_BACKOFF)
    elif cause is Cause.HALF_PRECISION_OVERFLOW:
        if (
            ins.promote
            and f.module
            and not f.true_half
            and f.promote_after is not None
            and f.module_overflows >= f.promote_after
        ):
            return _with_restore(f, [*acts, Action.PROMOTE], reason, promote=f.module)
    elif cause is Cause.GRADIENT_EXPLOSION and ins.rollback:
        acts.append(Action.ROLLBACK)
        if ins.backoff and "rollback" in f.backoff_triggers:
            acts.append(Action.BACKOFF)
    elif cause is Cause.CORRUPT_STATE:
        pass  # the restore below
    # Escalation: the same trouble keeps coming back.
    if f.max_consecutive_skips is not None and f.skip_streak > f.max_consecutive_skips:
        if ins.rollback and f.can_restore:
            acts.extend(a for a in (Action.ROLLBACK,) if a not in acts)
            if ins.backoff and "skip" in f.backoff_triggers and Action.BACKOFF not in acts:
                acts.append(Action.BACKOFF)
            reason = (
                f"{f.skip_streak} dropped updates in a row, more than max_consecutive_skips={f.max_consecutive_skips}"
            )
        else:
            return _stop(
                acts,
                f"{f.skip_streak} dropped updates in a row, more than max_consecutive_skips={f.max_consecutive_skips}",
            )
    elif (
        ins.backoff
        and "skip" in f.backoff_triggers
        and not cause.data_caused
        and f.recent_skips >= f.skips_before_backoff
        and Action.BACKOFF not in acts
    ):
        acts.append(Action.BACKOFF)
    if f.on_nonfinite == "stop" and ins.drop:
        return _stop(acts, 'GradNormMonitor(on_nonfinite="stop") stops at the first non-finite step')
    return _with_restore(f, acts, reason)


def _with_restore(f: RemedyFacts, acts: list[Action], reason: str, promote: str = "") -> Plan:
    """Add the restore a damaged state needs; stop when nothing can restore it; stop when the budget ran out."""
    if f.state_damaged or f.cause is Cause.CORRUPT_STATE:
        if not f.installed.rollback:
            return _stop(acts, "the state is non-finite and AutoRollback is not installed to restore it", promote)
        if not f.can_restore:
            return _stop(acts, "the state is non-finite and no verified snapshot or checkpoint exists yet", promote)
        if Action.ROLLBACK not in acts:
            acts.append(Action.ROLLBACK)
    if Action.ROLLBACK in acts and not f.can_restore:
        acts.remove(Action.ROLLBACK)
        if Action.BACKOFF in acts or f.cause is Cause.GRADIENT_EXPLOSION:
            reason = (reason + "; " if reason else "") + "no verified snapshot or checkpoint to restore yet"
    if Action.ROLLBACK in acts and f.rollback_budget_left <= 0:
        return _stop(acts, "the rollback budget (AutoRollback max_rollbacks per rollback_window) ran out", promote)
    return Plan(tuple(acts), reason, promote_module=promote)


def _stop(acts: list[Action], reason: str, promote: str = "") -> Plan:
    return Plan((*acts, Action.STOP), reason, stop=True, promote_module=promote)


def _collapse(f: RemedyFacts) -> Plan:
    mode = f.on_collapse
    if mode == "auto":
        mode = "rollback" if f.installed.rollback else "stop"
    if mode == "warn":
        if f.collapse_budget_left <= 0:
            return _stop(
                [Action.SCALER_SKIP], "the loss-scale collapse budget (LossScaleWatchdog max_collapses) ran out"
            )
        return Plan((Action.SCALER_SKIP, Action.WARN), 'LossScaleWatchdog(on_collapse="warn") keeps training')
    if mode == "stop" or not f.installed.rollback:
        why = (
            'LossScaleWatchdog(on_collapse="stop")'
            if mode == "stop"
            else "no AutoRollback is installed to restore a good state"
        )
        return _stop([Action.SCALER_SKIP], why)
    acts = [Action.SCALER_SKIP, Action.ROLLBACK]
    if f.installed.backoff and "loss_scale_collapse" in f.backoff_triggers:
        acts.append(Action.BACKOFF)
    if f.collapse_budget_left <= 0:
        return _stop(acts, "the loss-scale collapse budget (LossScaleWatchdog max_collapses) ran out")
    return _with_restore(f, acts, "the loss scale collapsed: the loss is exploding")


def _spike(f: RemedyFacts) -> Plan:
    if f.on_spike == "warn":
        return Plan((Action.WARN,), 'GradNormMonitor(on_spike="warn") lets the update through')
    acts = [Action.SKIP]
    if f.on_spike == "rollback" and f.installed.rollback:
        acts.append(Action.ROLLBACK)
        if f.installed.backoff and "rollback" in f.backoff_triggers:
            acts.append(Action.BACKOFF)
    if f.max_consecutive_skips is not None and f.skip_streak > f.max_consecutive_skips:
        return _stop(acts, f"{f.skip_streak} dropped updates in a row, more than max_consecutive_skips")
    return _with_restore(f, acts, "a loss/gradient-norm spike")


def _diverging(f: RemedyFacts) -> Plan:
    """The snapshot just taken was judged taken mid-divergence: the run is diverging now, while still finite.

    As for a gradient explosion: restore a sound state (the rollback passes over the snapshot, so a backoff planned
    with it goes one notch deeper) and lower the learning rate. Nothing is dropped: no update is at stake yet.
    """
    if not f.installed.rollback:
        return Plan((), "training is diverging, and no AutoRollback is installed to restore a sound state")
    acts = [Action.ROLLBACK]
    if f.installed.backoff and "rollback" in f.backoff_triggers:
        acts.append(Action.BACKOFF)
    return _with_restore(f, acts, "training is diverging: the newest snapshot was taken mid-divergence")


_CAUSE_REASONS = {
    Cause.INPUT_DATA: "the batch's inputs are bad; the model and optimizer are not at fault",
    Cause.TARGETS: "the batch's targets are bad; the model and optimizer are not at fault",
    Cause.TRANSIENT: "the fault did not reproduce",
    Cause.CORRUPT_STATE: "the parameters, buffers or optimizer state are non-finite",
    Cause.OPTIMIZER_NUMERICS: "finite gradients produced a non-finite update",
    Cause.HALF_PRECISION_OVERFLOW: "a module overflows in half precision",
    Cause.GRADIENT_EXPLOSION: "training is diverging",
    Cause.LOSS_FUNCTION: "the loss function produced a non-finite value from finite outputs",
    Cause.UNKNOWN: "",
}
