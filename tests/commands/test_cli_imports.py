"""``nanguard --version``, ``report`` and ``verify`` answer without importing Lightning (docs/PERFORMANCE.md, "The
nanguard command": about a second instead of several). Each runs in a fresh interpreter that says which modules
ended up imported; the figures themselves are ``benchmarks/cli_startup.py``'s, not asserted here."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from lightning_nanguard.checkpointing.verify import write_sidecar

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs main() as the console script does, then prints which of the heavy packages were imported.
PROBE = """
import json, sys
from lightning_nanguard.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:  # --version exits from argparse
    code = exit.code
heavy = ("lightning", "lightning.pytorch", "lightning_fabric", "torchmetrics", "torch._dynamo",
         "torch.distributed.tensor", "torch")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""


def _imported(*args: str, cwd: pathlib.Path) -> tuple[int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=cwd, env=env, capture_output=True, text=True, check=True, timeout=120
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return int(found["code"] or 0), list(found["imported"])


def test_version_imports_neither_lightning_nor_torch(tmp_path: pathlib.Path) -> None:
    code, imported = _imported("--version", cwd=tmp_path)
    assert code == 0
    assert imported == []


def test_report_imports_torch_but_not_lightning(tmp_path: pathlib.Path) -> None:
    run = tmp_path / "run"
    (run / "nanguard").mkdir(parents=True)
    record = {"step": 3, "trigger": "nonfinite_loss", "action": "skip", "actions": ["skip"], "cause": "bad_input"}
    (run / "nanguard" / "incidents.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    code, imported = _imported("report", str(run), cwd=tmp_path)
    assert code == 0
    assert imported == ["torch"]  # the records' vocabulary registers its enums with torch.load's safe globals


@pytest.mark.parametrize("damaged", [False, True])
def test_verify_imports_torch_alone(tmp_path: pathlib.Path, damaged: bool) -> None:
    ckpt = tmp_path / "model.ckpt"
    weights = torch.full((4, 4), float("nan")) if damaged else torch.ones(4, 4)
    torch.save({"state_dict": {"w": weights}}, ckpt)
    write_sidecar(str(ckpt))
    code, imported = _imported("verify", str(ckpt), cwd=tmp_path)
    assert code == (1 if damaged else 0)
    assert imported == ["torch"]


def test_the_other_commands_still_parse(tmp_path: pathlib.Path) -> None:
    """The commands left out of the light parser are there in the full one (``nanguard --help`` lists them)."""
    from lightning_nanguard import cli

    for light in (True, False):
        parser = cli.build_parser(light=light)
        names = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
        assert names == ({"report", "verify"} if light else {"report", "verify", "demo", "ablate", "replay"})
