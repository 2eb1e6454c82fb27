"""OptimizerBackoff's preflight: describe the Trainer's optimizers, run the pure checks, apply or report findings."""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_nanguard import _lightning_compat, _notices
from lightning_nanguard.callbacks._common import make_incident
from lightning_nanguard.contract import Action, Cause
from lightning_nanguard.engine import get_engine
from lightning_nanguard.exceptions import UnsupportedSetupError
from lightning_nanguard.policies.preflight import Finding, GroupInfo, OptimizerInfo, preflight_findings

__all__ = ["describe_optimizers", "run_preflight"]

OnHazard = Literal["fix", "warn", "raise", "off"]
# Reported but never fatal: true half precision is a legitimate choice, only a risk.
_NOTES = frozenset({"half_master"})


# The cause a hazard would become if it struck (found before step 1, not an event). A note has none: nothing went
# wrong, and "no float32 master copy" is not an overflow.
_CAUSES = {"eps_underflow": Cause.OPTIMIZER_NUMERICS.value}


def describe_optimizers(trainer: pl.Trainer) -> list[OptimizerInfo]:
    """The plain facts preflight needs about every optimizer of ``trainer`` (no host reads of tensor values)."""
    scaler_active = _lightning_compat.active_scaler(trainer) is not None
    out = []
    for i, opt in enumerate(trainer.optimizers):
        groups = tuple(
            GroupInfo(
                eps=float(g["eps"]) if isinstance(g.get("eps"), (int, float)) else None,
                fused=bool(g.get("fused")),
                dtypes=tuple(sorted({p.dtype for p in g["params"]}, key=str)),
            )
            for g in opt.param_groups
        )
        fused_with_scaler = scaler_active and _lightning_compat.optimizer_handles_unscaling(opt)
        out.append(OptimizerInfo(index=i, name=type(opt).__name__, groups=groups, fused_with_scaler=fused_with_scaler))
    return out


def run_preflight(trainer: pl.Trainer, on_hazard: OnHazard, safe_eps: float, source: str) -> list[Finding]:
    """Check, then fix / warn / raise per ``on_hazard``; every finding becomes an incident and a warning (notes: info).

    Raises:
        UnsupportedSetupError: ``on_hazard="raise"`` and a hazard (not a note) was found. Same on every rank, since
            the setup is.
    """
    if on_hazard == "off":
        return []
    clip = bool(trainer.gradient_clip_val) and float(trainer.gradient_clip_val or 0.0) > 0
    findings = preflight_findings(describe_optimizers(trainer), clip=clip, safe_eps=safe_eps)
    hazards = [f for f in findings if f.code not in _NOTES]
    if on_hazard == "raise" and hazards:
        raise UnsupportedSetupError(
            f'{source}(on_hazard="raise"): '
            + " ".join(f.message for f in hazards)
            + ' Or use on_hazard="fix" to let nanguard raise eps.'
        )
    incidents = get_engine(trainer).incidents
    for f in findings:
        message, action, values = f.message, Action.PREFLIGHT, dict(f.values)
        if on_hazard == "fix" and f.fixable and f.fix_eps is not None:
            _set_eps(trainer.optimizers[f.opt_idx], f.group_idx, f.fix_eps)
            message = f"{message} Fixed: nanguard set eps {f.values['eps']:g} -> {f.fix_eps:g}."
            action = Action.FIX
        # Reported, never fed to a decision: a preflight finding is not a training event.
        incidents.report(
            trainer,
            make_incident(
                trainer,
                trigger=f.code,
                action=action,
                source=source,
                values=values,
                message=message,
                cause=_CAUSES.get(f.code, ""),
            ),
        )
        # A note (true half precision is a legitimate choice) goes to the log; a hazard is a warning.
        report = _notices.note if f.code in _NOTES else _notices.warn
        report(f"{source} preflight: {message}")
    return findings


def _set_eps(optimizer: Optimizer, group_idx: int, eps: float) -> None:
    optimizer.param_groups[group_idx]["eps"] = float(eps)
