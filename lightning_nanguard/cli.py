"""The ``nanguard`` command: ``nanguard report RUN_DIR`` prints a run's incidents."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lightning_nanguard.context import INCIDENTS_FILE
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanguard", description="lightning_nanguard tools")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="print the incidents of a run (a log dir or an incidents.jsonl)")
    report.add_argument("path")
    report.add_argument("--limit", type=int, default=20, help="incidents to list (default 20)")
    report.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
