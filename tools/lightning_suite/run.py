"""Run a project's own test suite twice, plain and with nanguard's preset in every Trainer, and compare.

A compatibility check: a test of Lightning's, or of a project that trains with Lightning's ``Trainer``, that passes
plain and fails with the preset shows something nanguard changes for that project's users. Each such difference is
either a defect to fix or listed in ``intended/<project>.txt`` with the reason it is intended (a test that asserts
an exact file listing, which now holds nanguard's checksum sidecars): one ``test-id  # reason`` per line, where
``*`` in the id matches anything (``test_x[*]``: every parametrization). Files that the preset run leaves in the
project's tree and the plain run does not (nanguard's reports written into a working directory) are differences
too, listed as ``file: <glob>  # reason``. The projects and their slices are in ``projects.py``.

Usage (from this repository's root, in an environment with lightning_nanguard installed; never let pip change
torch, hence the constraints file)::

    git clone --branch 2.6.5 --depth 1 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install -c .ci/constraints.txt cloudpickle psutil pandas scikit-learn   # what Lightning's tests import
    python tools/lightning_suite/run.py --project lightning --source /tmp/pl --out /tmp/pl-compat

    git clone --branch 1.4.2 --depth 1 https://github.com/scverse/scvi-tools /tmp/scvi
    pip install -c .ci/constraints.txt scvi-tools==1.4.2
    python tools/lightning_suite/run.py --project scvi-tools --source /tmp/scvi --out /tmp/scvi-compat

(``--lightning DIR`` is short for ``--project lightning --source DIR``.) Take the checkout of the version that is
installed (for Lightning, the same minor version). Each run copies the project's tests into a fresh tree under
``--out`` (``plain-tree``, ``preset-tree``), writes both JUnit XML files and ``report.md`` (the table of
differences) into ``--out`` and prints the report; the preset run's tests keep their ``tmp_path`` folders under
``--out`` (``preset-tmp``), and every incident log with records there or in the tree is listed (``incidents.txt``): a
project's healthy tests should record none. Arguments it does not know go to pytest (``-k``, ``-x``...).
Exit 0 when every difference is intended, 1 when some are not, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from projects import HERE, PROJECTS, Project  # beside this file: the script's folder is sys.path[0]

# What nanguard writes on its own into a log directory (sidecars beside checkpoints are where they belong).
_OURS = ("nanguard", "incidents.jsonl", "summary.txt")


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
                first = (found.get("message") or found.text or "").strip().splitlines()[0:1]
                message = first[0][:160] if first else ""
                break
        out[name] = (outcome, message)
    return out


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` is a test id in which ``*`` matches anything (``[`` and ``]`` are literal: ``test_x[*]`` is every
    parametrization of ``test_x``)."""
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), name) is not None


def _intended(project: Project) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(test id pattern, reason) and (file glob, reason) pairs from the project's intended file."""
    tests: list[tuple[str, str]] = []
    files: list[tuple[str, str]] = []
    path = project.intended
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, _, reason = line.partition("#")
        pattern = pattern.strip()
        if pattern.startswith("file:"):
            files.append((pattern[len("file:") :].strip(), reason.strip()))
        else:
            tests.append((pattern, reason.strip()))
    return tests, files


def _tree(project: Project, source: Path, out: Path, mode: str) -> Path:
    """A fresh copy of the project's tests for one run, so that neither run sees the other's files."""
    tree = out / f"{mode}-tree"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    for rel in project.copy:
        src = source / rel
        if src.is_dir():
            # A report folder of nanguard's in the checkout (an earlier run in place) would read as this run's.
            ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", *_OURS)
            shutil.copytree(src, tree / rel, ignore=ignore)
        else:
            shutil.copy2(src, tree / rel)
    return tree / project.workdir


def _ours_left(tree: Path) -> set[str]:
    """Paths (relative to the run's tree) of nanguard's report folders and files (a folder's content not listed)."""
    found = set()
    for path in tree.rglob("*"):
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in _OURS):
            rel = path.relative_to(tree)
            if not any(fnmatch.fnmatch(part, _OURS[0]) for part in rel.parts[:-1]):
                found.add(rel.as_posix() + ("/" if path.is_dir() else ""))
    return found


def _place_data(project: Project, source: Path) -> None:
    """Copy the files the tests would download from the checkout into the installed module's folder."""
    for rel, module in project.data:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            continue
        target = Path(spec.origin).parent / Path(rel).name
        if not target.exists():
            print(f"run.py: copying {rel} to {target} (the tests would download it)", flush=True)
            shutil.copy2(source / rel, target)


def _incidents(*folders: Path) -> list[str]:
    """The incidents nanguard recorded during a run: ``<incidents.jsonl>: <line count>`` for each non-empty log."""
    found = []
    for folder in folders:
        for log in sorted(folder.rglob("incidents.jsonl")) if folder.is_dir() else ():
            lines = sum(1 for line in log.read_text(errors="replace").splitlines() if line.strip())
            if lines:
                found.append(f"{log}: {lines}")
    return found


def _run(project: Project, workdir: Path, xml: Path, inject: bool, timeout: int, paths: list[str], extra: list[str]):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(workdir), str(HERE) if inject else "", env.get("PYTHONPATH", "")) if p
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest"]
    if project.ini is not None:
        ini = xml.with_suffix(".ini")
        ini.write_text(project.ini)
        cmd += ["-c", str(ini)]
    cmd += ["--rootdir", str(workdir), "-q", "-p", "no:cacheprovider", "-o", "console_output_style=classic"]
    # The tests' tmp_path folders under --out, kept after the run: their incident logs are counted there.
    cmd += [f"--basetemp={xml.with_suffix('')}-tmp", f"--junitxml={xml}", f"--timeout={timeout}", *project.args]
    if inject:
        cmd += ["-p", "nanguard_inject"]
    cmd += extra + paths
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=workdir, env=env)


def _report(project: Project, out: Path) -> tuple[str, int]:
    a, b = _outcomes(out / "plain.xml"), _outcomes(out / "preset.xml")
    intended, intended_files = _intended(project)
    changed = sorted(k for k in a.keys() & b.keys() if a[k][0] == "passed" and b[k][0] == "failed")
    fixed = sorted(k for k in a.keys() & b.keys() if a[k][0] == "failed" and b[k][0] == "passed")
    lists = {}
    for mode in ("plain", "preset"):
        listed = out / f"{mode}-files.txt"
        lists[mode] = set(listed.read_text().split()) if listed.exists() else set()
    left = sorted(lists["preset"] - lists["plain"])
    lines = [
        f"# {project.name}'s tests with nanguard's preset in every Trainer",
        "",
        f"- tests run: {len(a)} plain, {len(b)} with the preset",
        f"- passed plain: {sum(v[0] == 'passed' for v in a.values())}; "
        f"with the preset: {sum(v[0] == 'passed' for v in b.values())}",
        f"- pass -> fail: {len(changed)}; fail -> pass: {len(fixed)}; in one run only: {len(a.keys() ^ b.keys())}",
        "",
        "| test | with the preset | intended? |",
        "|---|---|---|",
    ]
    unexpected = 0
    for name in changed:
        reason = next((r for p, r in intended if _matches(name, p)), "")
        unexpected += not reason
        lines.append(f"| `{name}` | {b[name][1].replace('|', '/')} | {reason or '**no**'} |")
    if fixed:
        lines += ["", "Failed plain, passed with the preset (not a difference nanguard makes; flaky or order):", ""]
        lines += [f"- `{name}`: {a[name][1]}" for name in fixed]
    lines += ["", f"nanguard's report files the preset run left in the project's tree: {len(left)}", ""]
    for path in left:
        reason = next((r for p, r in intended_files if fnmatch.fnmatch(path, p)), "")
        unexpected += not reason
        lines.append(f"- `{path}`: {reason or '**not intended**'}")
    logs = out / "incidents.txt"
    if logs.exists():
        # Not a difference by itself (a test may train on NaN on purpose), but each one is to be read.
        found = logs.read_text().splitlines()
        lines += ["", f"nanguard's incident logs with records (the tree and the tests' tmp_path): {len(found)}", ""]
        lines += [f"- `{line}`" for line in found]
    lines += ["", f"unexpected differences: {unexpected}"]
    return "\n".join(lines) + "\n", unexpected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", choices=sorted(PROJECTS), help="which project's suite (see projects.py)")
    parser.add_argument("--source", type=Path, help="the project's source checkout")
    parser.add_argument("--lightning", type=Path, help="short for --project lightning --source DIR")
    parser.add_argument("--out", required=True, type=Path, help="where the trees, XML files and report.md go")
    parser.add_argument("--paths", nargs="*", help="test paths (default: the project's slice in projects.py)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    parser.add_argument("--only", choices=("plain", "preset", "both"), default="both")
    parser.add_argument("--compare-only", action="store_true", help="only compare the results already in --out")
    args, extra = parser.parse_known_args(argv)
    if args.lightning is not None:
        args.project, args.source = args.project or "lightning", args.lightning
    if args.project is None or args.source is None:
        print("run.py: give --project and --source (or --lightning DIR)", file=sys.stderr)
        return 2
    project = PROJECTS[args.project]
    missing = [rel for rel in (*project.copy, *(d for d, _ in project.data)) if not (args.source / rel).exists()]
    if missing:
        print(f"run.py: {args.source} has no {', '.join(missing)}: not a {project.repo} checkout", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.compare_only:
        _place_data(project, args.source)
        for mode in ("plain", "preset"):
            if args.only not in (mode, "both"):
                continue
            workdir = _tree(project, args.source.resolve(), args.out.resolve(), mode)
            paths = list(args.paths or project.paths)
            _run(project, workdir, args.out.resolve() / f"{mode}.xml", mode == "preset", args.timeout, paths, extra)
            (args.out / f"{mode}-files.txt").write_text("\n".join(sorted(_ours_left(workdir))) + "\n")
            if mode == "preset":
                logs = _incidents(workdir, args.out.resolve() / "preset-tmp")
                (args.out / "incidents.txt").write_text("".join(f"{line}\n" for line in logs))
    report, unexpected = _report(project, args.out)
    (args.out / "report.md").write_text(report)
    print(report)
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
