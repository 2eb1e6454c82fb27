"""Replay an incident bundle offline: ``replay_bundle(bundle, model=...)``, what ``nanguard replay`` runs.

The step is re-run on a fresh LightningModule made for each precision from one of three sources:

* ``model=`` an instance of the user's own class (a notebook's, a script's): deep-copied for each run, so the
  instance itself is never changed;
* ``model=`` a factory (``nanguard replay --factory pkg.mod:make_model``): called with the bundle's recorded
  ``hparams`` as keyword arguments, it returns the module (for a module that takes a network as an argument);
* ``model=None``: the class the manifest names, imported by its dotted name from the installed environment (never
  from the bundle's directory) only after ``announce`` said which (``loading.module_class``), refused unless it is
  a ``LightningModule`` subclass, and built with the recorded ``hparams``.

Then, as Lightning does before a fit, ``configure_model()`` (a model built there is rebuilt), the bundle's
parameters and buffers loaded (every one the module has, and no other), the random states restored and the step run
with the origin traced (``replay.trace_pass``) at the ``global_step``, epoch and batch index it ran at, in each
precision. Without a Trainer: ``self.trainer`` is an ``OfflineTrainer`` and ``self.log`` a no-op. A bundle without
the full state re-runs the origin op alone (an aten op, on its recorded inputs). Everything that goes wrong before
the step runs is a ``BundleError`` saying what to do.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_nanguard import _lightning_compat
from lightning_nanguard.contract import Diagnosis, Signal
from lightning_nanguard.exceptions import BundleError, brief
from lightning_nanguard.forensics.bundle_codec import restore_rng, to_device
from lightning_nanguard.forensics.bundle_read import Bundle, read_bundle
from lightning_nanguard.forensics.loading import load_object, module_class
from lightning_nanguard.forensics.replay import trace_pass
from lightning_nanguard.forensics.step_view import OfflineTrainer
from lightning_nanguard.policies.diagnosis import offline_diagnosis
from lightning_nanguard.policies.findings import Findings, PassResult, ReplayFindings
from lightning_nanguard.policies.origin import Origin
from lightning_nanguard.signals.batch import read_batch

__all__ = ["PRECISIONS", "BundleReplay", "ReplayRun", "load_object", "module_class", "replay_bundle"]

PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed", "64-true")

ModelSource = pl.LightningModule | Callable[..., pl.LightningModule] | None


@dataclass(frozen=True)
class ReplayRun:
    """One re-run: of the whole step (``mode="step"``) or of the origin op alone (``"op"``), in ``precision``."""

    precision: str
    mode: str
    reproduced: bool
    origin: Origin | None = None
    error: str = ""
    op: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {"precision": self.precision, "mode": self.mode, "reproduced": self.reproduced}
        out.update(error=self.error, origin=self.origin.to_dict() if self.origin else None)
        return out | ({"op": self.op} if self.op else {})


@dataclass(frozen=True)
class BundleReplay:
    """What ``replay_bundle`` found: each run, and the cause decided from them by the incident's own rules."""

    bundle: Bundle
    runs: tuple[ReplayRun, ...]
    diagnosis: Diagnosis

    @property
    def origin(self) -> Origin | None:
        """The first run's origin that was found (the bundle's recorded one when no run found one)."""
        return next((r.origin for r in self.runs if r.origin), self.bundle.origin)

    @property
    def float32_fixes(self) -> bool | None:
        """Whether float32 makes the step finite (``None`` when it was recorded in 32-true)."""
        if self.runs[0].precision == "32-true":
            return None
        return not next(r for r in self.runs if r.precision == "32-true").reproduced

    @property
    def incident_cause(self) -> str:
        """The cause the incident named ("" when the bundle has no diagnosis)."""
        return str((self.bundle.manifest.get("diagnosis") or {}).get("cause", ""))


def replay_bundle(
    bundle: str | os.PathLike[str] | Bundle,
    model: ModelSource = None,
    *,
    precisions: Sequence[str] = (),
    device: str = "cpu",
    allow_pickle: bool = False,
    announce: Callable[[str], None] | None = None,
) -> BundleReplay:
    """Re-run the step an incident bundle recorded, in its precision, in float32 and in each of ``precisions``.

    Args:
        bundle: a bundle directory (``<log_dir>/nanguard/bundles/step-N``), its ``manifest.json``, or a ``Bundle``.
        model: your LightningModule (an instance: copied, never changed), a factory called with the recorded
            ``hparams`` as keyword arguments, or ``None`` for the class the bundle names (imported after
            ``announce`` says which).
        precisions: more precisions to re-run it in (``PRECISIONS``).
        device: where to re-run it (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        allow_pickle: read a batch stored with pickle (``batch.pkl``): only for a bundle you trust.
        announce: told, before it is imported, which class a ``model=None`` replay imports (default: stderr).

    Raises:
        BundleError: the bundle is damaged or cannot be replayed with this model (the message says what to do).

    Example::

        from lightning_nanguard import replay_bundle

        found = replay_bundle("lightning_logs/version_0/nanguard/bundles/step-20", model=Regressor())
        print(found.diagnosis.cause, found.origin)
    """
    if not isinstance(bundle, Bundle):
        bundle = read_bundle(os.fspath(bundle), allow_pickle=allow_pickle)
    m = bundle.manifest
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise BundleError(f"unknown precision {unknown[0]!r}: one of {', '.join(PRECISIONS)}")
    recorded = m["precision"] if m["precision"] in PRECISIONS else "32-true"
    order = list(dict.fromkeys([recorded, "32-true", *precisions]))
    if m["state"] != "full":
        if bundle.call is None:
            raise BundleError(
                f"{bundle.path} holds neither the module's state nor the origin op's inputs: nothing to re-run"
            )
        runs = [_op(bundle, precision, device) for precision in order]
        results = [
            PassResult(reproduced=r.reproduced, origin=bundle.origin if i == 0 else None) for i, r in enumerate(runs)
        ]
    else:
        make = _maker(bundle, model, announce or _to_stderr)
        runs, results = [], []
        for precision in order:
            result, origin = _step(bundle, make, precision, device)
            results.append(result)
            runs.append(ReplayRun(precision, "step", result.reproduced, origin, result.error))
    return BundleReplay(bundle, tuple(runs), cause_of(bundle, results, order))


def _to_stderr(message: str) -> None:
    print(f"nanguard replay: {message}", file=sys.stderr, flush=True)


def _maker(bundle: Bundle, model: ModelSource, announce: Callable[[str], None]) -> Callable[[], pl.LightningModule]:
    """A function that makes a fresh module for one run, from ``model`` (``replay_bundle``)."""
    m = bundle.manifest
    hparams = dict(m.get("hparams") or {})
    if isinstance(model, pl.LightningModule):
        instance = model
        return lambda: copy.deepcopy(instance)
    make: Callable[..., Any] = model if model is not None else module_class(m, announce, bundle.path)
    name = getattr(make, "__qualname__", type(make).__qualname__)

    def build() -> pl.LightningModule:
        try:
            made = make(**hparams)
        except Exception as err:
            skipped = m.get("hparams_skipped") or []
            extra = f"; the bundle could not record {skipped} (not JSON)" if skipped else ""
            raise BundleError(
                f"cannot build {name}(**{brief(hparams)}): {type(err).__name__}: {str(err)[:300]}{extra}. The bundle holds the "
                "arguments Lightning knows (self.save_hyperparameters() in __init__ records them): for a module "
                "that needs more (a network passed in), name a factory that builds it (nanguard replay --factory "
                "pkg.mod:make_model, called with those arguments), or pass your own instance from Python "
                "(lightning_nanguard.replay_bundle(bundle, model=...))"
            ) from err
        if not isinstance(made, pl.LightningModule):
            raise BundleError(f"{name}(**{brief(hparams)}) returned a {type(made).__qualname__}, not a LightningModule")
        return made

    return build


def _prepared(bundle: Bundle, make: Callable[[], pl.LightningModule]) -> pl.LightningModule:
    """A fresh module, configured as Lightning does before a fit, holding exactly the bundle's state."""
    model = make()
    try:
        model.configure_model()
    except Exception as err:
        raise BundleError(f"{type(model).__qualname__}.configure_model() failed: {type(err).__name__}: {err}") from err
    try:
        missing, unexpected = model.load_state_dict(bundle.state, strict=False)
    except RuntimeError as err:  # a shape differs
        raise BundleError(f"the bundle's state does not fit {type(model).__qualname__}: {err}") from err
    if missing or unexpected:
        which = f"lacks {missing[:5]}" if missing else f"has {unexpected[:5]}, which the module does not"
        raise BundleError(
            f"the bundle's state {which}: is this the class of the incident, and was it changed since? (a model "
            "built in configure_model() is built before the state is loaded)"
        )
    return model


def _plugin(precision: str, device: str) -> Precision:
    if precision in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(cast(Literal["16-mixed", "bf16-mixed"], precision), device)
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(cast(Literal["16-true", "bf16-true"], precision))
    return Precision()


def _dtype(precision: str) -> torch.dtype | None:
    return {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}.get(precision)


def _cast(obj: object, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj


def _no_log(*args: object, **kwargs: object) -> None:
    """``self.log`` in an offline replay: no Trainer, no logger."""


def _step(
    bundle: Bundle, make: Callable[[], pl.LightningModule], precision: str, device: str
) -> tuple[PassResult, Origin | None]:
    """One traced replay of the bundle's step in ``precision`` on ``device``, at the step, epoch and batch index the
    step ran at."""
    m = bundle.manifest
    model = _prepared(bundle, make)
    plugin = _plugin(precision, torch.device(device).type)
    dtype = _dtype(precision)
    batch = to_device(bundle.batch, device)
    if not precision.endswith("-mixed"):
        batch = _cast(batch, dtype or torch.float32)
    model = model.to(dtype=dtype) if dtype is not None else model.float()
    model.to(device).train()
    trainer = OfflineTrainer(int(m["step"]), int(m.get("epoch", 0)), precision, plugin)
    model.trainer = trainer  # type: ignore[assignment]
    model.log, model.log_dict = _no_log, _no_log  # type: ignore[method-assign]
    try:
        restore_rng(bundle.rng)
    except Exception as err:
        raise BundleError(f"damaged bundle {bundle.path}: its random states do not restore: {err}") from err
    scale = m.get("scale") if precision == m["precision"] else None
    traced = trace_pass(trainer, model, batch, int(m["batch_idx"]), scale=scale)
    return traced.result, traced.origin


def _op(bundle: Bundle, precision: str, device: str) -> ReplayRun:
    """The origin op alone, on the inputs it recorded (in their dtypes, or cast to float32)."""
    assert bundle.call is not None
    name, args, kwargs = bundle.call
    op = _lightning_compat.aten_op(name)
    args, kwargs = to_device(args, device), to_device(kwargs, device)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if op is None or not tensors:
        raise BundleError(f"{bundle.path}: op.pt names {name!r}, which is no aten op on recorded tensors")
    if precision == "32-true":
        args, kwargs = _cast(args, torch.float32), _cast(kwargs, torch.float32)
    try:
        out = op(*args, **kwargs)
    except Exception as err:
        raise BundleError(f"{bundle.path}: the origin op {name} fails on its recorded inputs: {err}") from err
    outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
    finite = all(bool(torch.isfinite(t).all()) for t in outs if t.is_floating_point())
    return ReplayRun(precision, "op", not finite, op=name)


def cause_of(bundle: Bundle, results: list[PassResult], precisions: list[str]) -> Diagnosis:
    """The cause of the replayed step, by the incident's own rules: the recorded precision's pass (with its origin),
    the float32 one, and the batch's evidence (the run's history is not in the bundle: a cause that rests on it, an
    explosion, can read otherwise here)."""
    recorded = precisions[0]
    hooked = results[0]
    fp32 = results[precisions.index("32-true")] if recorded != "32-true" else None
    batch = read_batch(bundle.batch, hooked.out_size)
    findings = Findings(
        Signal.NONFINITE_LOSS_AND_GRADS,
        batch=(batch,),
        batch_idx=int(bundle.manifest.get("batch_idx", -1)),
        half_precision=recorded.startswith(("16", "bf16")),
        precision=recorded,
        replay=(ReplayFindings(hooked=hooked, fp32=fp32),),
    )
    return offline_diagnosis(bundle.manifest.get("diagnosis") or {}, findings)
