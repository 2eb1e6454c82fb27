"""Every sentence nanguard says about a training event, in one place: what happened, where, why, what was done,
what to try. Each is built from facts checked at the time of writing (a message never asserts a state it did not
check)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_nanguard.contract import Action, Diagnosis, Plan, Signal, StopReason

__all__ = [
    "actions_phrase",
    "divergence_error",
    "final_state_error",
    "incident_message",
    "stop_message",
    "tried_phrase",
]

_SIGNAL_TEXT = {
    Signal.NONFINITE_LOSS: "non-finite loss",
    Signal.NONFINITE_GRADS: "non-finite gradients",
    Signal.NONFINITE_LOSS_AND_GRADS: "non-finite loss and gradients",
    Signal.NONFINITE_ON_OTHER_RANK: "a non-finite loss or gradient on another rank",
    Signal.NONFINITE_STATE: "non-finite parameters or buffers",
    Signal.RANK_DIVERGENCE: "parameters that differ across ranks",
    Signal.LOSS_SPIKE: "a loss spike",
    Signal.GRAD_NORM_SPIKE: "a gradient-norm spike",
    Signal.LOSS_AND_GRAD_NORM_SPIKE: "a loss and gradient-norm spike",
    Signal.DIVERGING: "a diverging run (loss and gradient norm far above the last sound snapshot's)",
    Signal.PROBE_ROSE: "a spike whose probe batch lost more too (the weights got worse)",
    Signal.LOSS_SCALE_COLLAPSE: "a loss-scale collapse (the fp16 GradScaler keeps overflowing)",
}

_ACTION_TEXT = {
    Action.SKIP: "dropped the update",
    Action.SCALER_SKIP: "the GradScaler dropped the update and lowered its scale",
    Action.QUARANTINE: "quarantined the data",
    Action.ROLLBACK: "rolled back",
    Action.BACKOFF: "lowered the learning rate",
    Action.EPS_BACKOFF: "raised Adam's eps",
    Action.PROMOTE: "moved a module to float32",
    Action.DEMOTE: "moved a module back to half precision",
    Action.WARN: "let the update through",
    Action.STOP: "stopped training",
}


def signal_text(signal: Signal) -> str:
    return _SIGNAL_TEXT.get(signal, signal.value.replace("_", " "))


def where_text(step: int, epoch: int, batch_idx: int, ranks: Sequence[int]) -> str:
    return f"global_step={step} (epoch {epoch}, batch {batch_idx}, ranks {list(ranks)})"


def actions_phrase(actions: Sequence[Action], details: Mapping[Action, str]) -> str:
    """``"dropped the update; rolled back to step 40 (memory)"``."""
    parts = []
    for a in actions:
        if a is Action.STOP:
            continue
        text = details.get(a) or _ACTION_TEXT.get(a, a.value)
        parts.append(text)
    return "; ".join(parts)


def cause_text(diagnosis: Diagnosis) -> str:
    where = f" at {diagnosis.where}" if diagnosis.where else ""
    note = f" ({diagnosis.note})" if diagnosis.note else ""
    return f"{diagnosis.cause.value.replace('_', ' ')}{where}{note}"


def incident_message(
    signal: Signal,
    where: str,
    diagnosis: Diagnosis,
    plan: Plan,
    details: Mapping[Action, str],
    why: str = "",
) -> str:
    """One incident in a sentence or three."""
    done = actions_phrase(plan.actions, details) or "nothing was done"
    why = f": {why}" if why else ""
    text = f"{signal_text(signal)} at {where}{why}. Cause: {cause_text(diagnosis)}. Done: {done}."
    if diagnosis.hint and not plan.stop:
        text += f" Hint: {diagnosis.hint}."
    return text


def tried_phrase(counts: Mapping[str, int], lr_scale: float | None) -> str:
    """What the run has tried so far, from the incident records' action counts."""
    names = {
        "skip": "dropped {n} update(s)",
        "scaler_skip": "the GradScaler dropped {n} update(s)",
        "quarantine": "quarantined data {n} time(s)",
        "rollback": "rolled back {n} time(s)",
        "backoff": "lowered the learning rate {n} time(s)",
        "eps_backoff": "raised eps {n} time(s)",
        "promote": "moved {n} module(s) to float32",
        "warn": "only warned, {n} time(s)",
    }
    parts = [names[a].format(n=n) for a, n in counts.items() if a in names and n]
    if lr_scale is not None and lr_scale < 1.0:
        parts.append(f"the learning rate is at {lr_scale:g}x its schedule")
    return "; ".join(parts) or "nothing"


def stop_message(
    signal: Signal,
    where: str,
    diagnosis: Diagnosis,
    plan: Plan,
    details: Mapping[Action, str],
    *,
    tried: str,
    state_now: str,
    checkpoint: str = "",
    why: str = "",
) -> str:
    """The stop error: what happened, where, the cause, what was tried, why it stopped, the state, what to try."""
    done = actions_phrase(plan.actions, details)
    why = f": {why}" if why else ""
    lines = [
        f"nanguard stopped training: {signal_text(signal)} at {where}{why}.",
        f"Cause: {cause_text(diagnosis)}.",
        f"Tried in this run: {tried}" + (f"; for this event: {done}" if done else "") + ".",
        f"Why it stopped: {plan.reason}.",
        f"State now: {state_now}" + (f"; a verified checkpoint was saved to {checkpoint}" if checkpoint else "") + ".",
        f"What to try: {_what_to_try(diagnosis, plan)}.",
    ]
    return " ".join(lines)


def final_state_error(names: Sequence[str], tried: str, hint: str) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"nanguard: training ended with non-finite parameters or buffers ({shown}) and nothing verified to "
        f"restore them. Tried in this run: {tried}. What to try: {hint or 'add AutoRollback() to restore the last good state'}; "
        "do not save or export this model."
    )


def divergence_error(names: Sequence[str], tried: str, hint: str) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"nanguard: training ended with the ranks' copies of {shown} different (finite, but DDP never re-broadcasts "
        "parameters, so each rank trained its own model from the step something changed one rank's copy) and "
        f"nothing verified identical on every rank to restore. Tried in this run: {tried}. What to try: {hint}; look "
        "for code that writes parameters on one rank only; do not take rank 0's model for the run's."
    )


_COLLAPSE_TIP = "lower the learning rate or train in bf16-mixed; add AutoRollback and OptimizerBackoff"
# What to try beyond the diagnosis' hint, by why training stopped.
_STOP_TIPS = {
    StopReason.NOTHING_RESTORES: "add AutoRollback() so a damaged state is restored instead of stopping",
    StopReason.ROLLBACK_BUDGET: "lower the learning rate, clip gradients, or raise AutoRollback(max_rollbacks=...)",
    StopReason.SKIP_BUDGET: "check the data at these steps, or raise GradNormMonitor(max_consecutive_skips=...)",
    StopReason.DROPPED_BUDGET: "fix that, or raise GradNormMonitor(max_dropped_fraction=...) (on_dropped_budget='warn' "
    "goes on with a warning); every dropped update is a step of training lost",
    StopReason.COLLAPSE_BUDGET: _COLLAPSE_TIP,
    StopReason.STOP_ON_COLLAPSE: _COLLAPSE_TIP,
}


def _what_to_try(diagnosis: Diagnosis, plan: Plan) -> str:
    tips = [diagnosis.hint] if diagnosis.hint else []
    tip = _STOP_TIPS.get(plan.stop) if plan.stop is not None else None
    if tip:
        tips.append(tip)
    return "; ".join(tips) or "check the data and the model at this step"
