"""The ``nanguard`` command.

* ``nanguard report RUN_DIR [--plot out.svg]`` prints a run's incidents (``RUN_DIR/nanguard/incidents.jsonl``) and
  plots its curves with the incidents marked; exit 3 when the run ended unrecovered.
* ``nanguard demo`` trains a small model on a real instability, unguarded and with the preset, side by side.
* ``nanguard ablate`` runs a grid of configurations (each stabilizer alone, all, none, or LightningCLI YAMLs).
* ``nanguard verify PATH...`` verifies checkpoint files (or every ``*.ckpt`` of a directory).
* ``nanguard replay BUNDLE`` re-runs an incident's step offline from its bundle (``commands.replay``).
* ``nanguard --version`` prints the installed version.

Exit codes are in ``EXIT_CODES`` (and in ``nanguard --help``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_nanguard.reporting.incidents import Incident

__all__ = ["EXIT_CODES", "build_parser", "main"]

EXIT_CODES = """\
exit codes:
  0  success: the report was printed (a run without incidents says "no incidents"), or every checkpoint verified
  1  nanguard verify: at least one checkpoint failed verification (each failure is printed with its reason)
  2  usage error, or no nanguard log where nanguard report looked (nor a run directory with nanguard's files), or a
     bundle nanguard replay cannot read or replay (damaged, crafted, or naming no LightningModule: nothing ran)
  3  nanguard report: the run ended unrecovered (nanguard stopped it, or its final parameters were non-finite)
"""


def _version() -> str:
    """The version of the code that runs: the package's own ``__version__`` (an editable install's metadata keeps the
    version it was installed at)."""
    from lightning_nanguard import __version__

    return __version__


def _report(args: argparse.Namespace) -> int:
    # Here, not at the top: a record's vocabulary (``contract``) imports torch, and ``--version`` answers without it.
    from lightning_nanguard.reporting.incidents import INCIDENTS_FILE, IncidentLog
    from lightning_nanguard.reporting.summary import FACTS_FILE, SUMMARY_FILE, RunFacts, format_summary

    path = args.path
    run_dir = path
    summary: str | None = None
    if os.path.isdir(path):
        candidates = [os.path.join(path, INCIDENTS_FILE), os.path.join(path, os.path.basename(INCIDENTS_FILE))]
        summaries = [os.path.join(path, SUMMARY_FILE), os.path.join(path, os.path.basename(SUMMARY_FILE))]
        summary = next((p for p in summaries if os.path.isfile(p)), None)
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found is None and summary is None and not os.path.isdir(os.path.join(path, os.path.dirname(INCIDENTS_FILE))):
            print(
                f"nanguard report: no nanguard log in {path} (looked for {candidates[0]}); pass the log "
                "directory of a run that had a logger, or its incidents.jsonl",
                file=sys.stderr,
            )
            return 2
        records, notes = IncidentLog.read_checked(found) if found is not None else ([], [])
        shown = found or path
    elif os.path.isfile(path):
        records, notes = IncidentLog.read_checked(path)
        shown = path
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        guess = os.path.join(run_dir, SUMMARY_FILE)
        summary = guess if os.path.isfile(guess) else None
    else:
        print(f"nanguard report: no incident log at {path}", file=sys.stderr)
        return 2
    for note in notes:  # damaged lines are left out, not fatal: a killed run is the one most worth a report
        print(f"nanguard report: note: {note}", file=sys.stderr)
    # Beside summary.txt: what the end-of-fit summary says beside the incidents.
    facts_file = os.path.join(os.path.dirname(summary), os.path.basename(FACTS_FILE)) if summary else None
    facts, facts_note = RunFacts.read(facts_file) if facts_file and os.path.isfile(facts_file) else (None, "")
    if records and facts is not None:  # the run's own summary, from its records: every callback, every line
        print(format_summary(records, facts.callbacks, shown, limit=args.limit, **facts.summary_arguments()))
    elif records:  # a run without its summary (killed before the end of fit, or written by 0.1.0)
        if facts_note:
            print(f"nanguard report: note: {facts_note}", file=sys.stderr)
        sources = sorted({s.strip() for r in records for s in r.source.split(",") if s.strip()})
        print(format_summary(records, sources, shown, limit=args.limit))
    elif notes:
        print(f"no readable incidents in {shown} ({len(notes)} damaged line(s) left out)")
    else:
        print(f"no incidents: nanguard recorded none in {path}")
        if summary is not None:
            with open(summary, encoding="utf-8", errors="replace") as f:
                print(f.read().rstrip("\n"))
    if args.plot:
        from lightning_nanguard.reporting.plot import write_plot

        try:
            write_plot(args.plot, run_dir, records)
        except RuntimeError as err:
            print(f"nanguard report: {err}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 3 if _unrecovered(records, summary) else 0


def _unrecovered(records: list[Incident], summary: str | None) -> bool:
    """Did the run end unrecovered: stopped by nanguard, or with non-finite final parameters?"""
    if any("stop" in (r.actions or [r.action]) for r in records):
        return True
    if summary is not None:
        with open(summary, encoding="utf-8", errors="replace") as f:
            return "NON-FINITE" in f.read()
    return False


def _verify(args: argparse.Namespace) -> int:
    # Here, not at the top: checking a checkpoint needs torch, and the other commands answer without it.
    from lightning_nanguard.checkpointing.manifest import is_distributed_checkpoint
    from lightning_nanguard.checkpointing.sidecar import read_sidecar
    from lightning_nanguard.checkpointing.verify import (
        SIDECAR_SUFFIX,
        checkpoint_candidates,
        verify_checkpoint,
        write_sidecar,
    )

    files: list[str] = []
    for path in args.paths:
        # A distributed checkpoint (a directory with a manifest or DCP's .metadata) is one checkpoint; any other
        # directory holds checkpoints: its *.ckpt files and distributed checkpoint directories.
        distributed = is_distributed_checkpoint(path)
        found = checkpoint_candidates(path) if os.path.isdir(path) and not distributed else [path]
        if not found:
            print(f"FAIL {path}: no *.ckpt files or distributed checkpoints in this directory")
            return 1
        files.extend(found)
    failed = 0
    for path in files:
        require = args.require_sidecar and not args.write_sidecar
        result = verify_checkpoint(path, require_sidecar=require)
        sidecar = read_sidecar(path) if result.ok and args.write_sidecar and os.path.isfile(path) else None
        # no sidecar, or a stale one (the file was written again after it): --write-sidecar writes it
        if result.ok and args.write_sidecar and os.path.isfile(path) and (sidecar is None or sidecar.stale):
            write_sidecar(path)
            print(f"OK   {path} (sidecar written: {os.path.basename(path)}{SIDECAR_SUFFIX})")
        elif result.ok:
            print(f"OK   {path}" + ("" if require else " (sidecar not required)"))
        else:
            failed += 1
            print(f"FAIL {path}: {result.reason}")
        if result.note:
            print(f"     note: {result.note}")
    if len(files) > 1:
        print(f"{len(files) - failed} of {len(files)} checkpoints verify")
    return 1 if failed else 0


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0 lists every incident), got {value}")
    return value


# Commands whose parsers are built without importing Lightning or torch: ``nanguard report ...``, ``nanguard verify
# ...`` and ``nanguard --version`` answer in about a second (the others import the modules their parsers name).
_LIGHT_COMMANDS = ("report", "verify")


def build_parser(*, light: bool = False) -> argparse.ArgumentParser:
    """The ``nanguard`` parser; ``light=True`` leaves out the commands whose parsers import Lightning (``demo``,
    ``ablate``, ``replay``)."""
    parser = argparse.ArgumentParser(
        prog="nanguard",
        description="lightning_nanguard tools: report a run's incidents, verify checkpoint files, replay an incident's "
        "step from its bundle, run the demo and ablation grids.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser(
        "report",
        help="print the incidents of a run (a log dir or an incidents.jsonl); exit 0, or 2 when there is no log",
        description="Print the incidents a run recorded (RUN_DIR/nanguard/incidents.jsonl). A run without incidents "
        'prints "no incidents". A line that is no incident record (the last one, cut short by a killed run) is left '
        "out with a note on stderr.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("path", metavar="RUN_DIR_OR_FILE", help="a run's log directory, or an incidents.jsonl file")
    report.add_argument(
        "--limit", type=_limit, default=20, help="incidents to list, first and last halves (default 20; 0 lists all)"
    )
    report.add_argument(
        "--plot",
        metavar="OUT",
        help="also write the run's loss, gradient norm, loss scale and LR scale with the incidents marked "
        "(.svg needs nothing; .png needs matplotlib: pip install 'lightning-nanguard[plot]')",
    )
    report.set_defaults(func=_report)
    verify = sub.add_parser(
        "verify",
        help="verify checkpoints (sha256 sidecar, loadable with weights_only=True, finite; a distributed checkpoint "
        "directory by its manifest); exit 1 on failure",
        description="Verify checkpoint files: the sha256 sidecar (without one, the zip CRC-32s torch stores), "
        "loadable with torch.load(weights_only=True), every weight and optimizer tensor finite (in any layout: a "
        "Lightning checkpoint, a plain state dict, ...). A distributed checkpoint (a directory written by "
        "ModelParallelStrategy under CheckpointGuard) is verified by its nanguard-manifest.json: every file's size "
        "and sha256, no unlisted shard, the finiteness checked on every rank at save time.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="checkpoint files, distributed checkpoint directories, or directories of either",
    )
    verify.add_argument(
        "--no-require-sidecar",
        dest="require_sidecar",
        action="store_false",
        help="accept a file without its .checksum sidecar (its CRC-32s and contents are still checked)",
    )
    verify.add_argument(
        "--write-sidecar",
        action="store_true",
        help="for a file without a sidecar (or with a stale one) whose contents verify, write the sidecar (trusting "
        "the file as it is now)",
    )
    verify.set_defaults(func=_verify)
    if light:
        return parser
    from lightning_nanguard.commands import ablate, demo, replay

    demo.add_parser(sub)
    ablate.add_parser(sub)
    replay.add_parser(sub)
    return parser


def _is_light(argv: Sequence[str]) -> bool:
    """``argv`` names a light command (its first word that is no option), or is ``--version`` alone."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in _LIGHT_COMMANDS or list(argv) == ["--version"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(light=_is_light(argv)).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
