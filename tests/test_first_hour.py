"""The first hour, as a newcomer spends it: a fresh clone, the README's first block run line by line in a fresh
virtual environment, then the commands that block promises (a test file, the site, LightningCLI).

Slow (a few minutes: it installs torch and every extra), so it runs only when asked:
``NANGUARD_FIRST_HOUR=1 python -m pytest -q tests/test_first_hour.py``. It installs from whatever index or cache pip
is configured with; nothing of the current environment is used but the Python that makes the venv.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SLOW = pytest.mark.skipif(
    os.environ.get("NANGUARD_FIRST_HOUR") != "1",
    reason="slow: set NANGUARD_FIRST_HOUR=1 to run the README's first hour",
)


def first_block() -> list[str]:
    """The commands of the README's first ``bash`` block ("Try it in a minute"), comments removed."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Try it in a minute") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    commands = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [c for c in commands if c]


def test_the_readme_block_is_what_this_test_runs() -> None:
    """What the first block asks for, in order: a venv, torch, the package with its extras, the demo, a test, the site
    (so that a change to the README changes this test, not only the prose)."""
    commands = first_block()
    assert commands[0].startswith("python -m venv .venv")
    assert any(c.startswith("pip install -e") and "dev" in c and "docs" in c for c in commands)
    assert "nanguard demo" in commands
    assert commands[-1] == "mkdocs serve"


@SLOW
@pytest.mark.timeout(3600)
def test_the_first_hour_from_a_fresh_clone(tmp_path: pathlib.Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    # The block as written, but `mkdocs serve` (which never returns) becomes the build it serves.
    lines = ["mkdocs build --strict --site-dir ../site" if c == "mkdocs serve" else c for c in first_block()]
    # Then what the first block says it made work: LightningCLI (jsonargparse, from the dev extra).
    lines.append("python examples/cli/train.py fit --config examples/cli/preset.yaml --trainer.max_epochs 1")
    script = "set -euo pipefail\n" + "\n".join(f"echo '+ {c}'\n{c}" for c in lines) + "\n"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "NANGUARD_FIRST_HOUR")}
    # `python` is the interpreter this test runs on, until the block's venv is activated: put its directory first.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        ["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=3000, check=False
    )
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert "nanguard summary" in done.stdout + done.stderr  # the demo's guarded run printed its summary
