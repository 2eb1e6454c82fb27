"""``nanguard replay BUNDLE``: re-run an incident's training step offline and name the origin of its first NaN.

The replay itself is ``forensics.offline.replay_bundle``: the bundle is read as data (``forensics.bundle_read``), the
LightningModule made from the class the bundle names (imported by its dotted name from the installed environment,
never from the bundle's directory, only after this command says which, and only if it is a ``LightningModule``
subclass), from ``--module pkg.mod:Class`` / ``--module path/to/script.py:Class``, or from
``--factory pkg.mod:make_model`` (called with the recorded ``hparams``), and the step re-run with the origin traced in
the recorded precision, in float32 and in any precision asked for with ``--precision``. The cause is decided from
what the replay found by the rules the incident used (``policies.diagnosis.offline_diagnosis``), and shown beside the cause the
incident named. Exit 0 when it ran, 2 on a usage error or a bundle that cannot be read or replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

import torch

from lightning_nanguard.forensics.bundle import BundleError, read_bundle
from lightning_nanguard.forensics.offline import PRECISIONS, load_object, replay_bundle
from lightning_nanguard.policies.causes import explain
from lightning_nanguard.policies.origin import Origin

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl

__all__ = ["add_parser", "run"]


class UsageError(Exception):
    """Something the user can fix: the message says what."""


def _model(args: argparse.Namespace) -> pl.LightningModule | Callable[..., pl.LightningModule] | None:
    """The module source the user chose (``--module``, ``--factory``), said before it is imported; ``None`` for the
    class the bundle names (``replay_bundle`` says which before importing it)."""
    if args.module and args.factory:
        raise UsageError("--module and --factory: give one (a LightningModule class, or a function that builds one)")
    spec = args.module or args.factory
    if not spec:
        return None
    flag = "--module" if args.module else "--factory"
    print(f"nanguard replay: importing {spec} ({flag})", file=sys.stderr, flush=True)
    return load_object(spec, want_class=bool(args.module))


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
        print(
            f"nanguard replay: {bundle.path}: step {m['step']} of {m['module']}:{m['qualname']}",
            file=sys.stderr,
            flush=True,
        )
        replayed = replay_bundle(bundle, _model(args), precisions=args.precision, device=args.device)
    except (BundleError, UsageError) as err:
        print(f"nanguard replay: {err}", file=sys.stderr)
        return 2
    runs = [r.to_dict() for r in replayed.runs]
    first = next((r for r in runs if r["origin"]), None)
    origin = Origin.from_dict(first["origin"]) if first else bundle.origin
    verdict = explain(origin)
    fixes = replayed.float32_fixes
    diagnosis = replayed.diagnosis
    named = replayed.incident_cause
    if args.json:
        out = {"bundle": bundle.path, "runs": runs, "float32_fixes": fixes, "verdict": verdict.to_dict()}
        out.update(cause=diagnosis.cause.value, where=diagnosis.where, hint=diagnosis.hint, incident_cause=named)
        print(json.dumps(out, indent=1))
        return 0
    print(f"bundle: {bundle.path}")
    print(
        f"module: {m['module']}:{m['qualname']} (step {m['step']}, epoch {m.get('epoch', 0)}, batch {m['batch_idx']}, "
        f"precision {m['precision']}, state {m['state']})"
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "replay",
        help="re-run an incident's step offline from its bundle and name the op and line of its first NaN",
        description="Re-run the training step an incident bundle recorded (<log_dir>/nanguard/bundles/step-N), in its "
        "precision and in float32, with the origin of the first non-finite value traced: the op, the file:line "
        "that called it, the statistics that explain it, whether float32 fixes it, and the verdict. A bundle is "
        "data: nothing it names runs, except the LightningModule class its manifest names, imported by its dotted "
        "name from the environment or the current directory (never from the bundle's directory: run it from the "
        "project's root) after this command prints which, and only if it is a "
        "LightningModule subclass (choose the class or a factory yourself with --module or --factory). Exit 0 "
        "when it ran, 2 on a usage error or a bundle that cannot be read or replayed.",
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
        help="read a batch stored with pickle (batch.pkl). Unpickling can run any code: only for a bundle you "
        "trust and whose origin you know",
    )
    p.add_argument(
        "--module",
        metavar="CLASS",
        help="the LightningModule class to build (with the recorded hparams) instead of the one the bundle names: "
        "pkg.mod:Class, or path/to/script.py:Class for a class defined in a script (loaded without running its "
        '`if __name__ == "__main__":` block)',
    )
    p.add_argument(
        "--factory",
        metavar="FUNCTION",
        help="a function that builds the LightningModule, called with the recorded hparams as keyword arguments "
        "(for a module that takes a network as an argument): pkg.mod:make_model or path/to/file.py:make_model",
    )
    p.set_defaults(func=run)
