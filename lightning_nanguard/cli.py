"""The ``nanguard`` command.

* ``nanguard report RUN_DIR`` prints a run's incidents.
* ``nanguard verify PATH...`` verifies checkpoint files (or every ``*.ckpt`` of a directory): exit 0 when all verify,
  1 when any fails (each failure printed with its reason).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lightning_nanguard.checkpoints import SIDECAR_SUFFIX, checkpoint_files, verify_checkpoint, write_sidecar
from lightning_nanguard.engine.sink import INCIDENTS_FILE
from lightning_nanguard.reporting.incidents import IncidentLog
from lightning_nanguard.reporting.summary import format_summary

__all__ = ["main"]


def _report(args: argparse.Namespace) -> int:
    path = args.path
    if os.path.isdir(path):
        path = os.path.join(path, INCIDENTS_FILE)
    if not os.path.isfile(path):
        print(f"nanguard report: no incident log at {path}", file=sys.stderr)
        return 2
    records = IncidentLog.read(path)
    print(format_summary(records, sorted({r.source for r in records}), path, limit=args.limit))
    return 0


def _verify(args: argparse.Namespace) -> int:
    files: list[str] = []
    for path in args.paths:
        found = checkpoint_files(path) if os.path.isdir(path) else [path]
        if not found:
            print(f"FAIL {path}: no *.ckpt files in this directory")
            return 1
        files.extend(found)
    failed = 0
    for path in files:
        require = args.require_sidecar and not args.write_sidecar
        result = verify_checkpoint(path, require_sidecar=require)
        if result.ok and args.write_sidecar and not os.path.isfile(path + SIDECAR_SUFFIX):
            write_sidecar(path)
            print(f"OK   {path} (sidecar written: {os.path.basename(path)}{SIDECAR_SUFFIX})")
        elif result.ok:
            print(f"OK   {path}" + ("" if require else " (sidecar not required)"))
        else:
            failed += 1
            print(f"FAIL {path}: {result.reason}")
    if len(files) > 1:
        print(f"{len(files) - failed} of {len(files)} checkpoints verify")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanguard", description="lightning_nanguard tools")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="print the incidents of a run (a log dir or an incidents.jsonl)")
    report.add_argument("path")
    report.add_argument("--limit", type=int, default=20, help="incidents to list (default 20)")
    report.set_defaults(func=_report)
    verify = sub.add_parser(
        "verify", help="verify checkpoints (sha256 sidecar, loadable with weights_only=True, finite); exit 1 on failure"
    )
    verify.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint files, or directories of *.ckpt files")
    verify.add_argument(
        "--no-require-sidecar",
        dest="require_sidecar",
        action="store_false",
        help="accept a file without its .sha256 sidecar (its contents are still checked)",
    )
    verify.add_argument(
        "--write-sidecar",
        action="store_true",
        help="for a file without a sidecar whose contents verify, write the sidecar (trusting the file as it is now)",
    )
    verify.set_defaults(func=_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
