"""``nanguard replay BUNDLE``: re-run an incident's training step offline and name the origin of its first NaN.

The bundle (``forensics.bundle``) records the LightningModule's import path and ``hparams``; the class is imported
from the current directory or ``PYTHONPATH`` and built with those arguments, its parameters and buffers loaded, and
the step replayed with the origin traced (``forensics.replay.trace_pass``): in the recorded precision, in float32,
and in any precision asked for with ``--precision``. A bundle holding only part of the state re-runs the origin op
alone from the inputs it recorded. The cause is decided from what the replay found by the rules the incident used
(``policies.diagnosis.classify``), and shown beside the cause the incident named. Exit 0 when it ran, 2 on a usage
error or an unreadable bundle.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_nanguard.contract import Diagnosis, Signal
from lightning_nanguard.forensics.bundle import Bundle, BundleError, read_bundle
from lightning_nanguard.forensics.bundle_codec import decode, restore_rng
from lightning_nanguard.forensics.replay import trace_pass
from lightning_nanguard.policies.causes import explain
from lightning_nanguard.policies.diagnosis import offline_diagnosis
from lightning_nanguard.policies.findings import Findings, PassResult, ReplayFindings
from lightning_nanguard.policies.origin import Origin
from lightning_nanguard.signals.batch import read_batch

__all__ = ["add_parser", "run"]

PRECISIONS = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed", "64-true")


class UsageError(Exception):
    """Something the user can fix: the message says what."""


def _plugin(precision: str, device: str) -> Any:
    if precision in ("16-mixed", "bf16-mixed"):
        return MixedPrecision(precision, device)  # type: ignore[arg-type]
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    return Precision()


def _dtype(precision: str) -> torch.dtype | None:
    return {"16-true": torch.float16, "bf16-true": torch.bfloat16, "64-true": torch.float64}.get(precision)


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj


def _module_class(manifest: dict[str, Any]) -> Any:
    module, qualname = manifest["module"], manifest["qualname"]
    if module == "__main__" or "<locals>" in qualname:
        raise UsageError(
            f"{qualname} was defined in a script's __main__ or inside a function: it cannot be imported again. "
            "Move the LightningModule into an importable module"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as err:
        raise UsageError(
            f"cannot import {module}:{qualname} ({err}): run nanguard replay from the project's root, or put the "
            "directory that holds the package on PYTHONPATH"
        ) from err
    return found


def _build(bundle: Bundle) -> Any:
    manifest = bundle.manifest
    cls = _module_class(manifest)
    hparams = manifest.get("hparams") or {}
    try:
        model = cls(**hparams)
    except Exception as err:
        skipped = manifest.get("hparams_skipped") or []
        extra = f"; the bundle could not record {skipped} (not JSON)" if skipped else ""
        raise UsageError(
            f"cannot build {manifest['qualname']}(**{hparams}): {type(err).__name__}: {err}{extra}. The bundle holds "
            "the arguments Lightning knows: call self.save_hyperparameters() in __init__, or make the class "
            "constructible without arguments"
        ) from err
    missing, _ = model.load_state_dict(bundle.state, strict=False)
    if missing:
        raise UsageError(f"the bundle's state lacks {missing[:5]}: was the class changed since the incident?")
    return model


def _step(bundle: Bundle, precision: str, device: str) -> Any:
    """One traced replay of the bundle's step in ``precision`` on ``device``."""
    model = _build(bundle)
    plugin = _plugin(precision, torch.device(device).type)
    dtype = _dtype(precision)
    batch = decode(bundle.batch, device)
    if not precision.endswith("-mixed"):
        batch = _cast(batch, dtype or torch.float32)
    model = model.to(dtype=dtype) if dtype is not None else model.float()
    model.to(device).train()
    restore_rng(bundle.rng)
    recorded = precision == bundle.manifest.get("precision")
    scale = bundle.manifest.get("scale") if recorded else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log.*")  # no Trainer here: logging is a no-op
        return trace_pass(
            SimpleNamespace(precision_plugin=plugin), model, batch, int(bundle.manifest["batch_idx"]), scale=scale
        )


def _op(bundle: Bundle, precision: str, device: str) -> dict[str, Any]:
    """The origin op alone, on the inputs it recorded (in their dtypes, or cast to float32)."""
    assert bundle.call is not None
    name, args, kwargs = bundle.call
    op: Any = torch.ops
    for part in name.split("."):
        op = getattr(op, part)
    args, kwargs = decode(args, device), decode(kwargs, device)
    if precision == "32-true":
        args, kwargs = _cast(args, torch.float32), _cast(kwargs, torch.float32)
    out = op(*args, **kwargs)
    outs = [t for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
    finite = all(bool(torch.isfinite(t).all()) for t in outs if t.is_floating_point())
    return {"precision": precision, "mode": "op", "op": name, "reproduced": not finite, "origin": None}


def _cause(bundle: Bundle, results: list[PassResult], precisions: list[str]) -> Diagnosis:
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


def _line(o: Origin) -> str:
    return f"{o.op} ({o.phase}{', ' + o.node if o.node else ''})" + (
        f" at {o.frame.file}:{o.frame.line} in {o.frame.function}" if o.frame else ""
    )


def _show(o: Origin) -> list[str]:
    lines = [f"  origin: {_line(o)}"]
    if o.frame is not None and o.frame.code:
        lines.append(f"      {o.frame.code}")
    stats = ", ".join(f"{k}={v}" for k, v in o.stats)
    lines += [
        f"    {label}: {value}"
        for label, value in (
            ("statistics", stats),
            ("rows", list(o.rows)),
            ("fields", ", ".join(o.fields)),
            ("note", o.note),
        )
        if value
    ]
    if o.masked_by:
        lines.append(
            f"    masked by: {o.masked_by}; surfaced in {o.surfaced_phase} ({o.surfaced_node or o.surfaced_op})"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: no CUDA device here")
        bundle = read_bundle(args.bundle, allow_pickle=args.allow_pickle)
        m = bundle.manifest
        precisions = list(dict.fromkeys([m.get("precision", "32-true"), "32-true", *args.precision]))
        by_step = m.get("state") == "full"
        if not by_step and bundle.call is None:
            raise UsageError(
                f"{bundle.path} holds neither the module's state nor the origin op's inputs: nothing to re-run"
            )
        runs = []
        results: list[PassResult] = []
        for precision in precisions:
            if by_step:
                traced = _step(bundle, precision, args.device)
                results.append(traced.result)
                o = traced.origin
                runs.append(
                    {
                        "precision": precision,
                        "mode": "step",
                        "reproduced": traced.result.reproduced,
                        "error": traced.result.error,
                        "origin": o.to_dict() if o else None,
                    }
                )
            else:
                run = _op(bundle, precision, args.device)
                runs.append(run)
                results.append(PassResult(reproduced=run["reproduced"], origin=bundle.origin if not results else None))
    except (BundleError, UsageError) as err:
        print(f"nanguard replay: {err}", file=sys.stderr)
        return 2
    first = next((r for r in runs if r["origin"]), None)
    origin = Origin.from_dict(first["origin"]) if first else bundle.origin
    verdict = explain(origin)
    fp32 = next(r for r in runs if r["precision"] == "32-true")
    fixes = None if precisions[0] == "32-true" else not fp32["reproduced"]
    diagnosis = _cause(bundle, results, precisions)
    named = str((m.get("diagnosis") or {}).get("cause", ""))
    if args.json:
        out = {"bundle": bundle.path, "runs": runs, "float32_fixes": fixes, "verdict": verdict.to_dict()}
        out.update(cause=diagnosis.cause.value, where=diagnosis.where, hint=diagnosis.hint, incident_cause=named)
        print(json.dumps(out, indent=1))
        return 0
    print(f"bundle: {bundle.path}")
    print(
        f"module: {m['module']}:{m['qualname']} (step {m['step']}, batch {m['batch_idx']}, precision {m['precision']}, state {m['state']})"
    )
    if bundle.origin is not None:
        print(f"recorded origin: {_line(bundle.origin)}")
    for r in runs:
        how = "the step" if r["mode"] == "step" else f"the origin op {r['op']} alone"
        result = "non-finite" if r["reproduced"] else "finite"
        print(
            f"replay of {how} in {r['precision']} on {args.device}: {result}"
            + (f" (error: {r['error']})" if r.get("error") else "")
        )
        if r["origin"]:
            print("\n".join(_show(Origin.from_dict(r["origin"]))))
    if fixes is not None:
        print(f"float32 fixes it: {'yes' if fixes else 'no (non-finite in float32 too)'}")
    print(f"verdict: {verdict.kind}: {verdict.summary}")
    same = (
        ""
        if not named
        else " (as the incident named)"
        if named == diagnosis.cause.value
        else f" (the incident named {named})"
    )
    print(f"cause: {diagnosis.cause.value}{same}" + (f" at {diagnosis.where}" if diagnosis.where else ""))
    hint = diagnosis.hint or verdict.hint
    if hint:
        print(f"hint: {hint}")
    print(f"data at fault: {'yes' if diagnosis.caused_by_data else 'no'}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay",
        help="re-run an incident's step offline from its bundle and name the op and line of its first NaN",
        description="Re-run the training step an incident bundle recorded (<log_dir>/nanguard/bundles/step-N), in its "
        "precision and in float32, with the origin of the first non-finite value traced: the op, the file:line "
        "that called it, the statistics that explain it, whether float32 fixes it, and the verdict. The "
        "LightningModule is imported by its recorded path from the current directory or PYTHONPATH. Exit 0 when "
        "it ran, 2 on a usage error or an unreadable bundle.",
    )
    p.add_argument("bundle", metavar="BUNDLE", help="a bundle directory (or its manifest.json)")
    p.add_argument("--device", default="cpu", help="where to re-run it: cpu (default), cuda, cuda:1, ...")
    p.add_argument(
        "--precision",
        action="append",
        default=[],
        choices=PRECISIONS,
        help="also re-run in this precision (repeatable); the recorded one and 32-true always run",
    )
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read a batch stored with pickle (batch.pkl; only for a bundle you trust)",
    )
    p.set_defaults(func=run)
