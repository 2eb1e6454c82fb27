"""The two bundles a new user meets first, the demo's and examples/quickstart.py's, replay with the documented commands.

Each test makes its bundle the way the docs say (the demo's runner; the quickstart run as a script, so its module is
defined in ``__main__``), takes the ``nanguard replay`` line from docs/FORENSICS.md's code block and runs it.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
from pathlib import Path
from typing import Any

import pytest

from lightning_nanguard import default_callbacks, replay_bundle
from lightning_nanguard.cli import main
from lightning_nanguard.demo import run_task

ROOT = Path(__file__).resolve().parents[2]


def _readme_command(flag: str) -> list[str]:
    """The docs' ``nanguard replay BUNDLE <flag> ...`` line (docs/FORENSICS.md), as argv (without ``nanguard``)."""
    text = (ROOT / "docs" / "FORENSICS.md").read_text(encoding="utf-8")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]
    line = next(ln for ln in lines if ln.startswith("nanguard replay BUNDLE") and f" {flag} " in ln)
    return shlex.split(line, comments=True)[1:]


def _replay(command: list[str], bundle: str, capsys: Any) -> dict[str, Any]:
    code = main([bundle if arg == "BUNDLE" else arg for arg in command] + ["--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


def test_the_demo_bundle_replays_with_the_readme_command(tmp_path: Path, capsys: Any) -> None:
    """The demo's module takes a network as an argument and saves no hyperparameters of its own: the README's
    ``--factory lightning_nanguard.demo:demo_module`` rebuilds it."""
    result = run_task("bad-data", default_callbacks(), root_dir=str(tmp_path), max_epochs=1, config="preset")
    bundle = next(inc.bundle for inc in result.incidents if inc.bundle)
    capsys.readouterr()
    out = _replay(_readme_command("--factory"), bundle, capsys)
    assert out["runs"][0]["reproduced"], out
    assert (out["cause"], out["incident_cause"]) == ("input_data", "input_data")


def test_the_quickstart_bundle_replays_with_the_readme_command(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/quickstart.py defines its module in the script (``__main__``): the README's ``--module
    examples/quickstart.py:Regressor`` loads it from the file; from Python, the user's own instance replays it."""
    monkeypatch.chdir(tmp_path)
    scope = runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    bundles = tmp_path / "lightning_logs" / "version_0" / "nanguard" / "bundles"
    bundle = str(next(bundles.iterdir()))
    with open(os.path.join(bundle, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    assert (manifest["module"], manifest["script"]) == ("__main__", str(ROOT / "examples" / "quickstart.py"))
    monkeypatch.chdir(ROOT)  # the README's path is relative to the repository
    capsys.readouterr()
    code = main(["replay", bundle])
    assert code == 2
    assert "--module " + str(ROOT / "examples" / "quickstart.py") + ":Regressor" in capsys.readouterr().err
    out = _replay(_readme_command("--module"), bundle, capsys)
    assert out["runs"][0]["reproduced"], out
    assert (out["cause"], out["incident_cause"]) == ("input_data", "input_data")
    found = replay_bundle(bundle, model=scope["Regressor"]())
    assert found.runs[0].reproduced
    assert found.diagnosis.cause.value == "input_data"
