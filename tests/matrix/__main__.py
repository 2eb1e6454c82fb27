"""Run the fault matrix: ``python -m tests.matrix --full`` (writes docs/RELIABILITY.md) or ``--subset``.

Options:
    --full | --kinds | --subset | --cases ID[,ID...] | --where DIM=V1|V2,...   what to run (``--full``:
                      ``spec.full_cases()``; ``--kinds``: its model-kind entries alone, the stratified slice of every
                      kind)
    --jobs N          processes at once (default 2)
    --rows PATH       append each row (JSON line) here as it finishes; with --resume, skip the cases already in it
    --out PATH        the Markdown report (default: docs/RELIABILITY.md for --full; none otherwise)
    --max-minutes M   start no case after M minutes (the report says how many were not run)
    --fresh fork|spawn  how each case's process starts (default fork: see tests/matrix/run.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

from tests.matrix.report import markdown, tally
from tests.matrix.run import judge, parse_case, run_cases
from tests.matrix.spec import Case, all_cases, full_cases, kinds_cases, subset_cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.matrix", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--full", action="store_true")
    group.add_argument("--kinds", action="store_true", help="the full run's model-kind entries alone")
    group.add_argument("--subset", action="store_true")
    group.add_argument("--cases", type=str)
    group.add_argument("--where", type=str, help="all pruned cases matching dim=v1|v2,dim=v (e.g. process=single)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rows", type=str, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--fresh", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--source", type=str, default="", help="what package source ran (a commit), for the report")
    parser.add_argument("--elapsed", type=str, default="", help="the run's wall time, for the report (--resume)")
    parser.add_argument("--report-only", action="store_true", help="write the report from --rows without running")
    args = parser.parse_args(argv)

    if args.full:
        cases, name = full_cases(), "--full"
        out = args.out or os.path.join("docs", "RELIABILITY.md")
    elif args.kinds:
        cases, name, out = kinds_cases(), "--kinds", args.out
    elif args.subset:
        cases, name, out = subset_cases(), "--subset", args.out
    elif args.where:
        cases, name, out = _where(args.where), "--where", args.out
    else:
        cases, name, out = [parse_case(c) for c in args.cases.split(",")], "--cases", args.out
    rows_path = args.rows or os.path.join(tempfile.gettempdir(), f"nanguard-matrix{name.replace('-', '_')}.jsonl")

    rows: list[dict] = []
    if (args.resume or args.report_only) and os.path.exists(rows_path):
        wanted = {str(c) for c in cases}
        with open(rows_path, encoding="utf-8") as f:
            # judged again: the invariants' code may be newer than the rows
            rows = [judge(Case.from_dict(r), r) for r in map(json.loads, filter(str.strip, f)) if r["case"] in wanted]
        done = {r["case"] for r in rows}
        cases = [c for c in cases if str(c) not in done]
    elif not args.report_only:
        open(rows_path, "w").close()

    started = time.monotonic()
    skipped: list[Case] = []
    if not args.report_only:
        print(f"{len(cases)} cases to run, {args.jobs} at a time; rows -> {rows_path}", flush=True)
        deadline = None if args.max_minutes is None else started + 60 * args.max_minutes
        budgeted = _until(cases, deadline, skipped)
        for i, row in enumerate(run_cases(budgeted, jobs=args.jobs, fresh=args.fresh), 1):
            rows.append(row)
            with open(rows_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            mark = "FAIL " + "; ".join(row["violations"]) if row["violations"] else "ok"
            elapsed = time.monotonic() - started
            print(
                f"[{i}/{len(cases)} {elapsed:6.0f}s] {row['case']}: {row['outcome']} {row['error']} {mark}", flush=True
            )
    totals = tally(rows)
    print(json.dumps(totals))
    if skipped:
        print(f"{len(skipped)} cases not started (--max-minutes)")
    if out:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        minutes = (time.monotonic() - started) / 60
        text = markdown(
            rows,
            title="Reliability: the fault matrix",
            command=f"python -m tests.matrix {name}",
            when=f"{when}, {args.elapsed or f'{minutes:.0f} min'}",
            sampled=args.full or args.kinds,
            kinds_only=args.kinds,
            source=args.source,
        )
        if skipped:
            text += f"\n{len(skipped)} cases of the plan were not started (time budget).\n"
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {out}")
    return 1 if any(r["violations"] for r in rows) else 0


def _where(text: str) -> list[Case]:
    wanted = {k: set(v.split("|")) for k, v in (part.split("=", 1) for part in text.split(","))}
    return [c for c in all_cases() if all(getattr(c, k) in vs for k, vs in wanted.items())]


def _until(cases: list[Case], deadline: float | None, skipped: list[Case]):  # type: ignore[no-untyped-def]
    for i, case in enumerate(cases):
        if deadline is not None and time.monotonic() > deadline:
            skipped.extend(cases[i:])
            return
        yield case


if __name__ == "__main__":
    sys.exit(main())
