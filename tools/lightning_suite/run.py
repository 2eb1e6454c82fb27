"""Run a slice of Lightning's own test suite twice, plain and with nanguard's preset in every Trainer, and compare.

A compatibility check: a test of Lightning's that passes plain and fails with the preset shows something nanguard
changes for a Lightning user. Each such difference is either a defect to fix or listed in ``intended.txt`` with
the reason it is intended (a test that asserts an exact file listing, which now holds nanguard's checksum sidecars):
one ``test-id  # reason`` per line, where ``*`` in the id matches anything (``test_x[*]``: every parametrization).

Usage (from this repository's root, in an environment with lightning_nanguard installed)::

    git clone --branch 2.6.5 --depth 1 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install cloudpickle psutil pandas scikit-learn    # what Lightning's tests import
    python tools/lightning_suite/run.py --lightning /tmp/pl --out /tmp/pl-compat

Take the Lightning checkout of the same minor version as the installed ``lightning``. It writes both JUnit XML files
and ``report.md`` (the table of differences) into ``--out`` and prints the report. Exit 0 when every difference is
intended, 1 when some are not, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Trainer, loops, checkpointing, logging and hooks: the parts of Lightning a callback suite can disturb.
DEFAULT_SLICE = (
    "tests_pytorch/trainer",
    "tests_pytorch/loops",
    "tests_pytorch/checkpointing",
    "tests_pytorch/loggers",
    "tests_pytorch/models/test_hooks.py",
)
_CONF = """[pytest]
addopts = --strict-markers -p no:cacheprovider --disable-pytest-warnings
markers =
    cloud: Run the cloud tests for example
xfail_strict = true
filterwarnings =
    error::FutureWarning
    ignore:You are using `torch.load` with `weights_only=False`.*:FutureWarning
    ignore::FutureWarning:torch.distributed.algorithms.ddp_comm_hooks
    ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated.*:FutureWarning
"""


def _outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the failure message)."""
    out: dict[str, tuple[str, str]] = {}
    if not xml.exists():
        return out
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (found.get("message") or found.text or "").strip().splitlines()[0:1]
                message = message[0][:160] if message else ""
                break
        out[name] = (outcome, message)
    return out


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` is a test id in which ``*`` matches anything (``[`` and ``]`` are literal: ``test_x[*]`` is every
    parametrization of ``test_x``)."""
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), name) is not None


def _intended() -> list[tuple[str, str]]:
    """(test id pattern, reason) pairs from intended.txt (``pattern  # reason`` per line)."""
    path = HERE / "intended.txt"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, _, reason = line.partition("#")
        rows.append((pattern.strip(), reason.strip()))
    return rows


def _run(tests: Path, paths: list[str], xml: Path, inject: bool, timeout: int, extra: list[str]) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tests), str(HERE) if inject else "", env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    ini = xml.with_suffix(".ini")
    ini.write_text(_CONF)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(ini),
        "--rootdir",
        str(tests),
        "-q",
        "-o",
        "console_output_style=classic",
    ]
    cmd += [f"--junitxml={xml}", f"--timeout={timeout}", "-m", "not cloud"]
    if inject:
        cmd += ["-p", "nanguard_inject"]
    cmd += extra + paths
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=tests, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lightning", required=True, type=Path, help="a Lightning source checkout (its tests/ folder is used)"
    )
    parser.add_argument("--out", required=True, type=Path, help="where the XML files and report.md go")
    parser.add_argument(
        "--paths", nargs="*", default=list(DEFAULT_SLICE), help="test paths under tests/ (default: the slice)"
    )
    parser.add_argument("--timeout", type=int, default=120, help="per-test timeout in seconds")
    parser.add_argument("--only", choices=("plain", "preset", "both"), default="both")
    parser.add_argument("--compare-only", action="store_true", help="only compare existing XML files in --out")
    args, extra = parser.parse_known_args(argv)
    tests = args.lightning / "tests"
    if not (tests / "tests_pytorch").is_dir():
        print(
            f"run.py: {tests}/tests_pytorch not found: --lightning must be a Lightning source checkout", file=sys.stderr
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plain, preset = args.out / "plain.xml", args.out / "preset.xml"
    if not args.compare_only:
        if args.only in ("plain", "both"):
            _run(tests, args.paths, plain, False, args.timeout, extra)
        if args.only in ("preset", "both"):
            _run(tests, args.paths, preset, True, args.timeout, extra)
    a, b = _outcomes(plain), _outcomes(preset)
    intended = _intended()
    changed = sorted(k for k in a.keys() & b.keys() if a[k][0] == "passed" and b[k][0] == "failed")
    fixed = sorted(k for k in a.keys() & b.keys() if a[k][0] == "failed" and b[k][0] == "passed")
    lines = [
        "# Lightning's tests with nanguard's preset in every Trainer",
        "",
        f"- tests run: {len(a)} plain, {len(b)} with the preset",
        f"- passed plain: {sum(v[0] == 'passed' for v in a.values())}; "
        f"with the preset: {sum(v[0] == 'passed' for v in b.values())}",
        f"- pass -> fail: {len(changed)}; fail -> pass: {len(fixed)}",
        "",
        "| test | with the preset | intended? |",
        "|---|---|---|",
    ]
    unexpected = 0
    for name in changed:
        reason = next((r for p, r in intended if _matches(name, p)), "")
        unexpected += not reason
        lines.append(f"| `{name}` | {b[name][1].replace('|', '/')} | {reason or '**no**'} |")
    lines += ["", f"unexpected differences: {unexpected}"]
    report = "\n".join(lines) + "\n"
    (args.out / "report.md").write_text(report)
    print(report)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
