"""Run one case of the fault matrix and judge it: a JSON row per run.

``execute(case, workdir)`` runs the fit in this process (the launcher process under DDP: the ranks are spawned) and
returns the row; ``run_case(case, workdir, timeout)`` runs it in a fresh child process in its own session, killed with
its whole process group (DDP ranks included) after ``timeout`` seconds, which makes a hang a row, not a stuck run.
``run_cases`` keeps ``jobs`` such children going at once.

The child is forked from a parent that has imported torch and Lightning but never trained (an import costs ~5 s on
this machine; a tiny fit well under one), so each case still starts from a process with no state from any other case;
``fresh="spawn"`` starts ``python -m tests.matrix.run --child`` instead.

Command line: ``python -m tests.matrix.run nan-once-grad-32-true-single-automatic-suite`` prints the row.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import fields
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_nanguard
from lightning_nanguard import last_good_checkpoint, verify_checkpoint
from lightning_nanguard.engine import get_engine
from lightning_nanguard.reporting.incidents import IncidentLog
from tests.matrix.fit import MatrixModel, build_trainer, callbacks_for
from tests.matrix.spec import DIMENSIONS, Case

__all__ = ["execute", "judge", "parse_case", "run_case", "run_cases"]

TIMEOUT_SINGLE = 90.0  # a case takes ~0.3 s alone, ~1 s on the loaded machine
TIMEOUT_DDP = 150.0  # ~8-15 s
DOCUMENTED = tuple(
    name
    for name in lightning_nanguard.__all__
    if isinstance(getattr(lightning_nanguard, name), type)
    and issubclass(getattr(lightning_nanguard, name), lightning_nanguard.NanGuardError)
)


def _training(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("action") not in _PREFLIGHT]


_PREFLIGHT = ("preflight", "fix")


def _occurrences(records: list[dict[str, Any]]) -> int:
    """Incidents, each occurrence once: a recurring incident is one record with its ``repeats``."""
    return sum(1 + int(r.get("repeats", 0)) for r in records)


def _finite(named: Iterable[tuple[str, torch.Tensor]], intended: frozenset[str] = frozenset()) -> bool:
    """Every floating tensor finite; the ``intended`` ones (infinities, no NaN, when training started: an attention
    mask of -inf) free of NaN. A sparse tensor through its stored values."""
    for name, t in named:
        v = t.coalesce().values() if t.is_sparse else t
        if v.is_floating_point() and not bool((torch.isnan(v) if name in intended else ~torch.isfinite(v)).any()):
            continue
        if v.is_floating_point():
            return False
    return True


def _intended_infinities(model: torch.nn.Module) -> frozenset[str]:
    """The buffers that hold infinities and no NaN before training: the promise exempts them (README)."""
    return frozenset(
        n
        for n, b in model.named_buffers()
        if b.is_floating_point() and not b.is_sparse and bool(torch.isinf(b).any()) and not bool(torch.isnan(b).any())
    )


def _error_name(exc: BaseException) -> tuple[str, str]:
    """(class name, traceback head) of the error; under ddp_spawn the rank's error arrives as text to parse."""
    text = "".join(traceback.format_exception(exc))
    name = type(exc).__name__
    if name == "ProcessRaisedException":
        chunk = str(exc).split("Traceback (most recent call last):")[-1]
        for line in chunk.splitlines():
            m = re.match(r"^([A-Za-z_][\w.]*)(: |$)", line)
            if m and not line.startswith(" "):
                name = m.group(1).rsplit(".", 1)[-1]
                break
        text = str(exc)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return name, "\n".join(lines[-12:])


def execute(case: Case, workdir: str) -> dict[str, Any]:
    """Run ``case`` here, in ``workdir``; the row (see ``judge`` for the verdicts)."""
    start = time.monotonic()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    os.makedirs(workdir, exist_ok=True)
    dump_dir = os.path.join(workdir, "ranks")
    ckpt_dir = os.path.join(workdir, "ckpt")
    os.makedirs(dump_dir, exist_ok=True)
    model = MatrixModel(case.optimization, case.model)
    intended = _intended_infinities(model)
    injector, callbacks = callbacks_for(case, workdir)
    row: dict[str, Any] = {"case": str(case), **case.to_dict()}
    error: BaseException | None = None
    trainer: pl.Trainer | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer = build_trainer(case, workdir, callbacks)
            trainer.fit(model)
        except Exception as exc:
            error = exc
    row["warnings"] = len(caught)
    if error is None:
        row["outcome"], row["error"], row["traceback"] = "returned", "", ""
    else:
        name, head = _error_name(error)
        documented = name in DOCUMENTED
        row["outcome"] = "documented_error" if documented else "other_error"
        row["error"], row["traceback"] = name, head

    dumps = []
    for r in range(2 if case.ddp else 1):
        path = os.path.join(dump_dir, f"rank{r}.pt")
        if os.path.exists(path):
            dumps.append(torch.load(path, weights_only=False))
    row["rank_steps"] = [d["step"] for d in dumps]
    row["global_step"] = max(row["rank_steps"], default=-1)

    # Finite state: every rank's parameters and buffers, as the fit left them.
    if case.ddp:
        states = [d["state"] for d in dumps if d["final"]] if error is None else []
        row["finite"] = bool(states) and all(_finite(s.items(), intended) for s in states)
    else:
        row["finite"] = _finite([*model.named_parameters(), *model.named_buffers()], intended)
    if row["outcome"] == "returned":
        row["outcome"] = "finite" if row["finite"] else "nonfinite_return"

    # Rank divergence: the ranks' final parameters (or, after an error, their last ones at the same step), compared
    # bit for bit (NaN equals NaN). Buffers are not compared: without SyncBatchNorm each rank's running statistics
    # take its own batch after DDP's broadcast from rank 0 at the start of each forward, so they differ by design.
    row["diverged"] = None
    if case.ddp and len(dumps) == 2:
        a, b = dumps
        if a["step"] == b["step"]:
            row["diverged"] = any(
                not torch.equal(a["state"][k].view(-1).view(torch.uint8), b["state"][k].view(-1).view(torch.uint8))
                for k in a["params"]
            )
        elif error is None:
            row["diverged"] = True

    # Faults injected (distinct optimizer steps hit, over every rank) and incidents recorded.
    injected = [tuple(i) for d in dumps for i in d["injected"]] if case.ddp else list(injector.injected)
    row["faults"] = len({i[0] for i in injected})
    # Incidents: rank 0's incidents.jsonl (under DDP; in memory in a single process), less the preflight findings
    # (a setup note or an eps fix at step 0, not a training event: not caused by a fault).
    log_path = os.path.join(workdir, "log", "version_0", "nanguard", "incidents.jsonl")
    if case.ddp:
        records = [i.to_dict() for i in IncidentLog.read(log_path)] if os.path.exists(log_path) else []
        row["incidents_per_rank"] = [_occurrences(_training(d["incidents"])) for d in dumps]
    else:
        records = [i.to_dict() for i in get_engine(trainer).sink.records] if trainer is not None else []
    events = _training(records)
    row["incidents"] = _occurrences(events)
    row["incident_actions"] = [i["action"] for i in events]
    row["setup_notes"] = len(records) - len(events)

    # Checkpoints: after a documented error, the newest checkpoint that verifies (if any was written).
    row["checkpoint"] = None
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        good = last_good_checkpoint(ckpt_dir, require_sidecar=False)
        row["checkpoint"] = (
            "none_verifies" if good is None else ("ok" if verify_checkpoint(good, require_sidecar=False).ok else "bad")
        )
    row["wall_s"] = round(time.monotonic() - start, 2)
    return judge(case, row)


def judge(case: Case, row: dict[str, Any]) -> dict[str, Any]:
    """Add ``violations``: the invariants of issue 12 (F) this row breaks."""
    v: list[str] = []
    outcome = row["outcome"]
    if outcome == "nonfinite_return":
        v.append("fit returned normally with non-finite parameters or buffers")
    elif outcome == "other_error":
        v.append(f"raised {row['error']}, not a documented NanGuardError")
    elif outcome == "hang":
        v.append("hang: killed after the hard timeout")
    elif outcome == "crash":
        v.append("the run's process died without a result")
    if row.get("diverged") and outcome == "finite":
        v.append("rank divergence: the ranks' parameters differ")
    if case.counts_incidents and outcome in ("finite", "documented_error") and row["incidents"] != row["faults"]:
        v.append(f"incidents ({row['incidents']}) != faults injected ({row['faults']})")
    if (
        case.callbacks == "suite"
        and outcome == "documented_error"
        and row.get("checkpoint") in ("none_verifies", "bad")
    ):
        v.append("stopped with the documented error, but no checkpoint it left verifies")
    row["incidents_match"] = (row["incidents"] == row["faults"]) if case.nonfinite and "incidents" in row else None
    row["violations"] = v
    return row


# ---------------------------------------------------------------------------------------------- fresh processes
def _failed_row(case: Case, outcome: str, wall: float, log: str) -> dict[str, Any]:
    row: dict[str, Any] = {
        "case": str(case),
        **case.to_dict(),
        "outcome": outcome,
        "error": "",
        "wall_s": round(wall, 2),
    }
    row.update(finite=None, diverged=None, faults=None, incidents=None, checkpoint=None)
    row["traceback"] = _tail(log)
    return judge(case, row)


def _tail(path: str, lines: int = 12) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "\n".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return ""


def _child(case: Case, workdir: str, out: str) -> None:
    try:
        row = execute(case, workdir)
    except BaseException as exc:  # the harness itself failed: report it as the row
        row = _failed_row(case, "crash", 0.0, "")
        row["traceback"] = "".join(traceback.format_exception(exc))[-2000:]
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(row, f)
    os.replace(out + ".tmp", out)


class _Running:
    def __init__(
        self, case: Case, pid: int, workdir: str, deadline: float, start: float, proc: subprocess.Popen[bytes] | None
    ) -> None:
        self.case, self.pid, self.workdir, self.deadline, self.start = case, pid, workdir, deadline, start
        self.proc = proc

    def poll(self) -> tuple[bool, int]:
        """(finished, status), without blocking."""
        if self.proc is not None:
            code = self.proc.poll()
            return code is not None, code or 0
        done, status = os.waitpid(self.pid, os.WNOHANG)
        return done != 0, status

    def reap(self) -> None:
        if self.proc is not None:
            self.proc.wait()
        else:
            os.waitpid(self.pid, 0)

    @property
    def out(self) -> str:
        return os.path.join(self.workdir, "row.json")

    @property
    def log(self) -> str:
        return os.path.join(self.workdir, "output.log")


_PORTS = iter(range(29500 + (os.getpid() % 500) * 40, 65000))  # a distinct MASTER_PORT per DDP job of this parent


def _next_port() -> int:
    """A port no other job of this run was given and that is free now: two DDP jobs started together would otherwise
    both pick the same free port in their own processes (EADDRINUSE, or one rank joining the other's group)."""
    import socket

    for port in _PORTS:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for a DDP job")


def _start(case: Case, root: str, timeout: float | None, fresh: str) -> _Running:
    port = str(_next_port()) if case.ddp else None  # given to the child only (no leak into this process)
    workdir = tempfile.mkdtemp(prefix=str(case)[:60] + "-", dir=root)
    log = os.path.join(workdir, "output.log")
    limit = timeout if timeout is not None else (TIMEOUT_DDP if case.ddp else TIMEOUT_SINGLE)
    start = time.monotonic()
    proc = None
    if fresh == "fork":
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: its own session (so its process group, DDP ranks included, can be killed)
            code = 0
            try:
                os.setsid()
                if port is not None:
                    os.environ["MASTER_PORT"] = port
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                _child(case, workdir, os.path.join(workdir, "row.json"))
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
    else:
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.matrix.run", "--child", json.dumps(case.to_dict()), workdir],
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=_REPO,
                env={**os.environ, **({"MASTER_PORT": port} if port is not None else {})},
            )
        pid = proc.pid
    return _Running(case, pid, workdir, start + limit, start, proc)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _finish(job: _Running, status: int | None, keep: bool) -> dict[str, Any]:
    wall = time.monotonic() - job.start
    if status is None:  # timed out
        row = _failed_row(job.case, "hang", wall, job.log)
    elif os.path.exists(job.out):
        with open(job.out, encoding="utf-8") as f:
            row = json.load(f)
        row["wall_s"] = round(wall, 2)
    else:
        row = _failed_row(job.case, "crash", wall, job.log)
        row["error"] = f"exit status {status}"
    _kill_group(job.pid)  # stray ranks of a finished or killed case
    if not keep:
        shutil.rmtree(job.workdir, ignore_errors=True)
    else:
        row["workdir"] = job.workdir
    return row


def run_cases(
    cases: Iterable[Case],
    jobs: int = 2,
    timeout: float | None = None,
    root: str | None = None,
    fresh: str = "fork",
    keep: bool = False,
) -> Iterator[dict[str, Any]]:
    """Run ``cases``, ``jobs`` at a time, each in a fresh process killed (with its group) at its timeout; yields each
    row as it finishes (not in order)."""
    if fresh == "fork" and not hasattr(os, "fork"):
        fresh = "spawn"
    own_root = root is None
    root = root or tempfile.mkdtemp(prefix="nanguard-matrix-")
    pending = iter(cases)  # pulled lazily: the caller's iterator may stop early (a time budget)
    exhausted = False
    running: dict[int, _Running] = {}
    try:
        while not exhausted or running:
            while not exhausted and len(running) < jobs:
                case = next(pending, None)
                if case is None:
                    exhausted = True
                    break
                job = _start(case, root, timeout, fresh)
                running[job.pid] = job
            time.sleep(0.05)
            for pid, job in list(running.items()):
                done, status = job.poll()
                if done:
                    del running[pid]
                    yield _finish(job, status, keep)
                elif time.monotonic() > job.deadline:
                    _kill_group(pid)
                    job.reap()
                    del running[pid]
                    yield _finish(job, None, keep)
    finally:
        for pid, job in running.items():
            _kill_group(pid)
            job.reap()
        if own_root and not keep:
            shutil.rmtree(root, ignore_errors=True)


def run_case(case: Case, timeout: float | None = None, fresh: str = "fork", keep: bool = False) -> dict[str, Any]:
    """Run one case in a fresh process with a hard timeout; its row."""
    return next(iter(run_cases([case], jobs=1, timeout=timeout, fresh=fresh, keep=keep)))


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_case(text: str) -> Case:
    """A case from its id (``str(case)``) or its JSON dict."""
    if text.lstrip().startswith("{"):
        return Case.from_dict(json.loads(text))
    names = [f.name for f in fields(Case)]
    # ids join the dimensions with "-", which some values contain: match the longest known value first
    values: list[str] = []
    rest = text
    for name in names:
        for option in sorted(DIMENSIONS[name], key=len, reverse=True):
            if rest == option or rest.startswith(option + "-"):
                values.append(option)
                rest = rest[len(option) + 1 :]
                break
        else:
            raise SystemExit(f"cannot read {name!r} from {rest!r} (case id {text!r})")
    return Case(**dict(zip(names, values, strict=True)))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--child":  # fresh="spawn": python -m tests.matrix.run --child <case json> <workdir>
        _child(parse_case(argv[1]), argv[2], os.path.join(argv[2], "row.json"))
        return 0
    if not argv:
        print(__doc__)
        return 2
    row = run_case(parse_case(argv[0]), keep="--keep" in argv)
    print(json.dumps(row, indent=2))
    return 1 if row["violations"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
