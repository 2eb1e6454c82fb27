"""One classifier: the online incident and ``nanguard replay`` of its bundle name the same cause, place and data at
fault, for every cause in the registry (``policies.causes``). Walks the registry: a cause decided from the origin is
built from its ``CauseSpec.example``; one decided from evidence a bundle does not hold (the state, the step's
signals, the history) is taken from the record offline; the replay-decided rest from a small corpus."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_nanguard.contract import Basis, Cause, Signal
from lightning_nanguard.policies.causes import CAUSES, EVIDENCE, explain
from lightning_nanguard.policies.diagnosis import classify, offline_diagnosis, strip_rows
from lightning_nanguard.policies.findings import Findings, PassResult, ReplayFindings
from lightning_nanguard.policies.origin import HALF, Origin
from lightning_nanguard.signals.batch import BatchFindings

BAD = Signal.NONFINITE_LOSS_AND_GRADS


def _step(origin: Origin | None, batch: BatchFindings | None = None, **passed: object) -> Findings:
    """An incident's findings, as the engine gathers them for one rank (and as a bundle's replay gives them back)."""
    half = bool({origin.output_dtype, *origin.input_dtypes} & set(HALF)) if origin is not None else False
    hooked = PassResult(**{"reproduced": True, "loss_finite": False, "origin": origin, **passed})  # type: ignore[arg-type]
    batch = batch or BatchFindings(nonfinite_rows=origin.rows if origin is not None and origin.phase == "input" else ())
    return Findings(
        BAD,
        batch=(batch,),
        batch_idx=2,
        half_precision=half,
        precision="16-true" if half else "32-true",
        replay=(ReplayFindings(hooked=hooked),),
    )


def _offline(f: Findings) -> Findings:
    """What ``nanguard replay`` builds from the bundle: the replay and the batch, nothing of the run around it."""
    return Findings(
        BAD,
        batch=f.batch,
        batch_idx=f.batch_idx,
        half_precision=f.half_precision,
        precision=f.precision,
        replay=f.replay,
    )


def _same(online_findings: Findings) -> tuple[Cause, ...]:
    online = classify(online_findings)
    offline = offline_diagnosis(online.to_dict(), _offline(online_findings))
    assert (offline.cause, offline.where, offline.caused_by_data) == (online.cause, online.where, online.caused_by_data)
    return (online.cause,)


CORPUS: list[Findings] = [
    _step(None, reproduced=False, loss_finite=True),  # transient
    _step(None, first_module="head", first_kind="output", outputs_finite=True),  # loss_function
    _step(None, first_module="head", first_kind="output", outputs_finite=False),  # unknown (no growth)
    _step(
        Origin("aten.mse_loss.default", "input", fields=("[1]",), rows=(3,), batch_size=4),
        BatchFindings(nonfinite_target_rows=(3,)),
    ),  # targets (a NaN target)
    _step(
        Origin("aten.acos.default", "forward", rows=(0, 1, 2, 3), batch_size=4),
        BatchFindings(target_rows=(1,), target_min=0, target_max=9, output_size=5),
        out_size=5,
    ),  # targets (class labels out of range: the heuristic, nothing measured)
]


def _deferred(cause: Cause) -> bool:
    """Every rule of ``cause`` rests on evidence a bundle does not hold: offline, the incident's cause stands."""
    rules = [r for r in EVIDENCE if r.cause is cause]
    return bool(rules) and all(r.basis in (Basis.STATE, Basis.SIGNAL, Basis.HISTORY) for r in rules)


@pytest.mark.parametrize("cause", [c for c, s in CAUSES.items() if s.diagnosed], ids=lambda c: c.value)
def test_every_cause_reads_the_same_online_and_offline(cause: Cause) -> None:
    spec = CAUSES[cause]
    seen: set[Cause] = set()
    if spec.pattern is not None:
        assert spec.example is not None, f"{cause.value}: a pattern needs an example origin"
        assert spec.pattern(spec.example) is not None
        assert explain(spec.example).kind == cause.value  # the pattern is the one place it is mapped
        seen.update(_same(_step(spec.example)))
        # A data blame tested and withdrawn online (the counterfactual) is withdrawn offline too.
        online = classify(_step(spec.example))
        if online.caused_by_data:
            withdrawn = replace(
                classify(strip_rows(_step(spec.example))), caused_by_data=False, counterfactual={"quarantine": False}
            )
            offline = offline_diagnosis(withdrawn.to_dict(), _offline(_step(spec.example)))
            assert (offline.cause, offline.where, offline.caused_by_data) == (
                withdrawn.cause,
                withdrawn.where,
                False,
            )
    elif _deferred(cause):
        recorded = {"cause": cause.value, "where": "x", "decided_by": Basis.STATE.value, "caused_by_data": False}
        offline = offline_diagnosis(recorded, _offline(_step(None)))
        seen.add(offline.cause)
        assert (offline.where, offline.caused_by_data) == ("x", False)
    else:
        for f in CORPUS:
            seen.update(_same(f))
    assert cause in seen, f"{cause.value}: no pattern example, no deferral and no corpus case decides it"
