"""The end-of-fit check: a fit that returns normally has finite parameters and buffers, identical on every rank
(DDP); otherwise the newest verified state is restored, or the fit raises.

It runs twice (``engine.Engine``): at ``on_train_end``, on the device, where a restore finds everything as training
left it; and again as the fit ends (the first nanguard callback's ``teardown``), after every callback's
``on_train_end`` and ``on_fit_end`` and the LightningModule's: whatever those wrote into the model is checked too.
Lightning's weight-averaging callbacks (``EMAWeightAveraging``, ``StochasticWeightAveraging``) copy their average into
the model in their ``on_train_end``, wherever they stand in the callback list; an average that took in a NaN update
is NaN, so the second check restores the newest verified state or raises, as the first does.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_nanguard import _distributed
from lightning_nanguard.contract import (
    Action,
    Cause,
    Diagnosis,
    RestoreSource,
    Signal,
    StateRestored,
)
from lightning_nanguard.engine.accounting import FitLedger
from lightning_nanguard.engine.act import restored_text
from lightning_nanguard.engine.capabilities import Restored, Restorer
from lightning_nanguard.engine.incidents import IncidentPath
from lightning_nanguard.engine.state_check import model_finite, state_verdict
from lightning_nanguard.exceptions import NonFiniteTrainingError, RankDivergenceError
from lightning_nanguard.policies.diagnosis import divergence_diagnosis, listed_names
from lightning_nanguard.reporting import messages
from lightning_nanguard.reporting.incidents import Incident
from lightning_nanguard.signals.model_tensors import nonfinite_names

__all__ = ["final_check"]

_LATE = (
    " after the end-of-fit check (a callback's on_train_end or on_fit_end wrote into the model, as a weight-averaging "
    "callback does: an average that took in a NaN update is NaN)"
)
_NOTHING_VERIFIED = (
    "AutoRollback had no verified snapshot or checkpoint to restore: snapshot more often (every_n_steps)"
)


def final_check(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    restorer: Restorer | None,
    ledger: FitLedger,
    incidents: IncidentPath,
    tried: str,
    *,
    again: bool = False,
) -> None:
    """Check the state at the end of fit (a collective: every rank reaches ``on_train_end`` and ``teardown``);
    restore or raise (the error is left in ``ledger.pending_error``).

    ``tried``: what the run has tried so far, for the error's message. ``again``: the second check, after the
    callbacks' last hooks (module docstring): a sound state keeps the first check's verdict."""
    verdict = state_verdict(trainer, pl_module)
    if verdict.sound:
        if not (again and ledger.final_state):
            ledger.final_state = "finite (checked at the end of fit)"
        return
    late = _LATE if again else ""
    if verdict.finite:  # under DDP, finite parameters whose copies differ across the ranks
        names = list(verdict.diverged)
        signal, diagnosis = Signal.RANK_DIVERGENCE, divergence_diagnosis(verdict.diverged)
        problem = f"the ranks' parameters differ at the end of fit ({listed_names(names, 5)}){late}"
        promise, error = "every rank returns the same model", messages.divergence_error
        restored_state = "finite and identical on every rank"
        because = f"the ranks' copies of {listed_names(names)} differed{late}"
        unrestored = f"finite, but the ranks' copies of {listed_names(names)} DIFFER"
        add = "add AutoRollback() so the last state verified identical on every rank is restored"
    else:
        gathered = _distributed.all_gather_objects(trainer, nonfinite_names(pl_module))
        names = sorted({n for part in gathered for n in part})
        signal = Signal.NONFINITE_STATE
        diagnosis = Diagnosis(
            Cause.CORRUPT_STATE, where=listed_names(names), state_tensors=tuple(names), state_damaged=True
        )
        problem = f"non-finite parameters or buffers at the end of fit ({listed_names(names, 5)}){late}"
        promise, error = "the model fit() returns is finite", messages.final_state_error
        restored_state = "finite"
        because = (
            f"{listed_names(names)} became non-finite{late}"
            if again
            else f"{listed_names(names)} ended training non-finite (the last updates, or a callback's on_train_end)"
        )
        unrestored = f"NON-FINITE ({listed_names(names)})"
        add = "add AutoRollback() so the last verified state is restored"
    restored = _restore_at_end(
        trainer, pl_module, signal, diagnosis, restorer, incidents, problem=problem, promise=promise
    )
    if restored is not None:
        ledger.final_state = (
            f"{restored_state}: restored from step {restored.step} ({restored.source}) at the end of fit, because "
            f"{because}"
        )
        return
    ledger.final_state = unrestored
    hint = _NOTHING_VERIFIED if restorer is not None else add
    if again:
        hint = f"the state became non-finite{_LATE}; {hint}"
    if ledger.pending_error is None:
        kind = RankDivergenceError if signal is Signal.RANK_DIVERGENCE else NonFiniteTrainingError
        ledger.pending_error = kind(error(names, tried, hint))


def _restore_at_end(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    signal: Signal,
    diagnosis: Diagnosis,
    restorer: Restorer | None,
    incidents: IncidentPath,
    *,
    problem: str,
    promise: str,
) -> Restored | None:
    """Restore the newest verified state and record the incident (``problem``: what was found; ``promise``: what the
    restore guarantees). ``None`` when nothing verified could be restored."""
    if restorer is None or not restorer.can_restore(trainer, trainer.global_step):
        return None
    restored = restorer.restore(trainer, pl_module, trainer.global_step)
    if restored is None or not model_finite(trainer, pl_module):
        return None
    incident = Incident(
        step=trainer.global_step,
        epoch=int(trainer.current_epoch),
        batch_idx=-1,
        ranks=list(range(trainer.world_size)),
        trigger=signal,
        action=Action.ROLLBACK,
        source=restorer.owner,
        values={"restored_from_step": restored.step, "rollback_source": restored.source},
        message=f"{problem}: {restored_text(restored)}, so {promise}. The last updates were lost.",
        actions=[Action.ROLLBACK],
        cause=Cause.CORRUPT_STATE,
        where=diagnosis.where,
        diagnosis=diagnosis.to_dict(),
    )
    incidents.report(trainer, incident)
    incidents.bus.emit(trainer, StateRestored(restored.step, RestoreSource(restored.source)))
    return restored
