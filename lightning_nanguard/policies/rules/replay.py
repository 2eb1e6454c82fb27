"""Rules on the replay of the batch (pre-update weights, hooks on every module, then float32): tried when no cheap
rule decided and a replay ran without raising (``replay_usable``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_nanguard.contract import Cause, Diagnosis, Evidence, EvidenceKind
from lightning_nanguard.policies.findings import HUGE_OUTPUT, Findings, PassResult, history_evidence

__all__ = [
    "finite_but_huge",
    "half_precision_module",
    "loss_of_finite_outputs",
    "loss_of_huge_outputs",
    "no_float32_pass",
    "nonfinite_in_float32",
    "nonfinite_without_growth",
    "not_reproduced",
    "replay_usable",
]


def replay_usable(f: Findings) -> bool:
    """A replay ran on some rank and no pass raised."""
    return any(p.hooked is not None for p in f.replay) and not f.replay_errors


def _reproduced(f: Findings) -> list[tuple[int, PassResult, PassResult | None]]:
    return [(r, p.hooked, p.fp32) for r, p in enumerate(f.replay) if p.hooked is not None and p.hooked.reproduced]


def _on(f: Findings, rank: int) -> str:
    return f" on rank {rank}" if len(f.replay) > 1 else ""


def finite_but_huge(f: Findings) -> Diagnosis | None:
    """Nothing reproduced, but gradients or outputs reached ``1e15``: a norm or a square of them overflows (the
    step's grad norm did), so the model is diverging."""
    if _reproduced(f):
        return None
    huge = [
        (r, p.hooked)
        for r, p in enumerate(f.replay)
        if p.hooked is not None and max(p.hooked.max_abs_grad, p.hooked.max_abs_output) >= HUGE_OUTPUT
    ]
    if not huge:
        return None
    rank, p = huge[0]
    top = max(p.max_abs_grad, p.max_abs_output)
    return Diagnosis(
        Cause.GRADIENT_EXPLOSION,
        where=f"{p.max_abs_module or 'the model'}{_on(f, rank)} (finite but huge: gradients up to "
        f"{p.max_abs_grad:.3g}, outputs up to {p.max_abs_output:.3g})",
        evidence=(
            Evidence(
                EvidenceKind.REPLAY_FP32_NONFINITE,
                f"the replay's values are finite but reach {top:.3g}: their squares overflow float32",
                {"max_abs_grad": p.max_abs_grad, "max_abs_output": p.max_abs_output},
            ),
            history_evidence(f),
        ),
        ranks=tuple(r for r, _ in huge),
        module=p.max_abs_module,
    )


def not_reproduced(f: Findings) -> Diagnosis | None:
    """The same batch on the same weights was finite on every rank."""
    if _reproduced(f):
        return None
    return Diagnosis(
        Cause.TRANSIENT,
        where=f"batch {f.batch_idx} (not reproduced)",
        evidence=(
            Evidence(
                EvidenceKind.REPLAY_NOT_REPRODUCED,
                "the same batch on the same weights gave a finite loss, outputs and gradients on every rank",
            ),
        ),
    )


def loss_of_huge_outputs(f: Findings) -> Diagnosis | None:
    """A non-finite loss from finite module outputs so large that squaring them overflows: the model diverged, the
    loss only showed it."""
    hits = _reproduced(f)
    if not hits:
        return None
    rank, hooked, _ = hits[0]
    if hooked.loss_finite or not hooked.outputs_finite or hooked.max_abs_output < HUGE_OUTPUT:
        return None
    size = f"{hooked.max_abs_output:.3g}"
    return Diagnosis(
        Cause.GRADIENT_EXPLOSION,
        where=f"{hooked.max_abs_module}{_on(f, rank)} (outputs up to {size}: the loss overflowed from their size)",
        evidence=(
            Evidence(
                EvidenceKind.REPLAY_LOSS_ONLY,
                f"every module output was finite but reached {size}, the loss was not finite",
                {"max_abs_output": hooked.max_abs_output, "module": hooked.max_abs_module},
            ),
            history_evidence(f),
        ),
        ranks=tuple(r for r, _, _ in hits),
        module=hooked.max_abs_module,
    )


def loss_of_finite_outputs(f: Findings) -> Diagnosis | None:
    """The replay reproduced a non-finite loss while every module output was finite."""
    hits = _reproduced(f)
    if not hits:
        return None
    rank, hooked, _ = hits[0]
    if hooked.loss_finite or not hooked.outputs_finite:
        return None
    return Diagnosis(
        Cause.LOSS_FUNCTION,
        where=f"the loss of training_step{_on(f, rank)} (every module output finite)",
        evidence=(Evidence(EvidenceKind.REPLAY_LOSS_ONLY, "every module output was finite, the loss was not"),),
        ranks=tuple(r for r, _, _ in hits),
    )


@dataclass(frozen=True)
class _First:
    """The first non-finite value the replay found, and the module to name for it."""

    module: str  # the module to name (the parent, when the child's input was already non-finite)
    child: str  # the module whose output was first non-finite
    evidence: Evidence
    ranks: tuple[int, ...]
    on: str
    fp32: list[PassResult]  # the float32 passes of the ranks that reproduced


def _first(f: Findings) -> _First | None:
    hits = _reproduced(f)
    if not hits:
        return None
    rank, hooked, _ = hits[0]
    on = _on(f, rank)
    module = hooked.first_module or "?"
    child = module
    in_range = (
        ""
        if hooked.input_min is None or hooked.input_max is None
        else f", its input in [{hooked.input_min:.4g}, {hooked.input_max:.4g}]"
    )
    summary = f"the first non-finite {hooked.first_kind or 'value'} was {module}'s{on} ({hooked.dtype}){in_range}"
    inputs_bad = any(v is not None and not math.isfinite(v) for v in (hooked.input_min, hooked.input_max))
    if inputs_bad and hooked.first_kind == "output" and module != "?":
        # Its input was already non-finite: the overflow happened in the parent's own forward code (an op between
        # submodules, e.g. `self.proj(h * 300)`), so the parent is the module to name (and to run in float32).
        module = module.rsplit(".", 1)[0] if "." in module else ""
        summary = (
            f"the first non-finite output was {child}'s{on} ({hooked.dtype}), whose input was already non-finite"
            f"{in_range}: {module or 'the LightningModule'}'s own forward overflowed before calling it"
        )
    evidence = Evidence(
        EvidenceKind.REPLAY_FIRST_MODULE,
        summary,
        {
            "module": module,
            "first_kind": hooked.first_kind,
            "input_min": hooked.input_min,
            "input_max": hooked.input_max,
            "dtype": hooked.dtype,
            "rank": rank,
        },
    )
    fp32 = [x for _, _, x in hits if x is not None]
    return _First(module, child, evidence, tuple(r for r, _, _ in hits), on, fp32)


def half_precision_module(f: Findings) -> Diagnosis | None:
    """The replay names a module under a half precision and the float32 replay is finite."""
    first = _first(f) if f.half_precision else None
    if first is None or not first.fp32 or any(x.reproduced for x in first.fp32):
        return None
    inside = f" (its own forward, before {first.child})" if first.child != first.module else ""
    return Diagnosis(
        Cause.HALF_PRECISION_OVERFLOW,
        where=f"{first.module or '<the LightningModule>'}{inside}{first.on} (finite in float32)",
        evidence=(
            first.evidence,
            Evidence(EvidenceKind.REPLAY_FP32_FINITE, "the same batch is finite in float32", {"module": first.module}),
        ),
        ranks=first.ranks,
        module=first.module,
    )


def _growth(f: Findings, first: _First) -> bool:
    """Evidence of growth, which an explosion needs: the history was rising, or the replay's finite values reach
    ``HUGE_OUTPUT`` (in the training precision or in float32)."""
    passes = [p.hooked for p in f.replay if p.hooked is not None] + first.fp32
    return f.history.rising or any(max(p.max_abs_output, p.max_abs_grad) >= HUGE_OUTPUT for p in passes)


def _nonfinite_again(f: Findings, first: _First) -> str:
    """How the replay was non-finite beyond the training precision ("" when float32 fixed it or was not tried)."""
    if not f.half_precision:
        return f"non-finite in {f.precision}"
    return "non-finite in float32 too" if any(x.reproduced for x in first.fp32) else ""


def nonfinite_in_float32(f: Findings) -> Diagnosis | None:
    """The replay is non-finite in float32 too (or the run trains in float32) and the model was growing into it
    (``_growth``): a divergence, module named."""
    first = _first(f)
    again = _nonfinite_again(f, first) if first is not None else ""
    if first is None or not again or not _growth(f, first):
        return None
    return Diagnosis(
        Cause.GRADIENT_EXPLOSION,
        where=f"{first.module}{first.on} ({again})",
        evidence=(
            first.evidence,
            Evidence(EvidenceKind.REPLAY_FP32_NONFINITE, f"the same batch is {again}"),
            history_evidence(f),
        ),
        ranks=first.ranks,
        module=first.module,
    )


def nonfinite_without_growth(f: Findings) -> Diagnosis | None:
    """Non-finite in float32 too, with no sign of growth (a flat history, no huge value): no explosion, so no
    rollback and no lower learning rate; the module is named and the origin, where one was traced, says more."""
    first = _first(f)
    again = _nonfinite_again(f, first) if first is not None else ""
    if first is None or not again:
        return None
    return Diagnosis(
        Cause.UNKNOWN,
        where=f"{first.module}{first.on} ({again})",
        evidence=(
            first.evidence,
            Evidence(EvidenceKind.REPLAY_FP32_NONFINITE, f"the same batch is {again}"),
            history_evidence(f),
        ),
        ranks=first.ranks,
        module=first.module,
        note="no sign of growth (the gradient norm and the loss were not rising, no value reached 1e15): not an "
        "explosion",
    )


def no_float32_pass(f: Findings) -> Diagnosis | None:
    """Half precision, reproduced, but no float32 pass (its budget): the module, not the class."""
    first = _first(f)
    if first is None:
        return None
    return Diagnosis(
        Cause.UNKNOWN,
        where=f"{first.module}{first.on}",
        evidence=(first.evidence,),
        ranks=first.ranks,
        module=first.module,
        note="no float32 replay to tell an overflow from a divergence",
    )
