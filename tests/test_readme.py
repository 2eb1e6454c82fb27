"""The README tells the truth: every default it shows for a callback is the constructor's real default."""

from __future__ import annotations

import ast
import glob
import inspect
import os
import re

import pytest

import lightning_nanguard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as _f:
    README = _f.read()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for block in BLOCKS:
        stripped = block.strip()
        if not re.match(r"^[A-Z]\w+\(", stripped):
            continue  # only the signature blocks, e.g. "GradNormMonitor(\n    on_nonfinite=...,\n)"
        node = ast.parse(stripped).body[0]
        assert isinstance(node, ast.Expr)
        assert isinstance(node.value, ast.Call)
        assert isinstance(node.value.func, ast.Name)
        calls.append((node.value.func.id, node.value))
    return calls


CALLS = _calls()


def test_every_callback_has_a_signature_block() -> None:
    documented = {name for name, _ in CALLS}
    exported = {
        n
        for n in lightning_nanguard.__all__
        if n[0].isupper() and hasattr(getattr(lightning_nanguard, n), "on_fit_start")
    }
    assert exported <= documented


@pytest.mark.parametrize(("name", "call"), CALLS, ids=[n for n, _ in CALLS])
def test_documented_defaults_are_real(name: str, call: ast.Call) -> None:
    params = inspect.signature(getattr(lightning_nanguard, name)).parameters
    for kw in call.keywords:
        assert kw.arg in params, f"README shows {name}({kw.arg}=...), which does not exist"
        assert ast.literal_eval(kw.value) == params[kw.arg].default, f"README default of {name}({kw.arg}) is stale"


@pytest.mark.parametrize(("name", "call"), CALLS, ids=[n for n, _ in CALLS])
def test_every_constructor_argument_is_documented(name: str, call: ast.Call) -> None:
    params = set(inspect.signature(getattr(lightning_nanguard, name)).parameters)
    shown = {kw.arg for kw in call.keywords}
    assert params == shown, f"README's {name}(...) block misses {sorted(params - shown)}"


def test_every_logged_tag_is_documented() -> None:
    from lightning_nanguard.reporting import keys

    tags = [getattr(keys, k) for k in keys.__all__ if k.isupper() and k != "PREFIX"]
    missing = [t for t in tags if f"`{t}" not in README]
    assert not missing, f"README does not mention {missing}"


def test_every_incident_action_is_documented() -> None:
    from lightning_nanguard.contract import Action

    missing = [a.value for a in Action if a is not Action.NONE and f"`{a.value}`" not in README]
    assert not missing, f"README does not list the incident action(s) {missing}"


def _nanguard_commands() -> list[str]:
    """Every ``nanguard ...`` command the README shows: in bash blocks (comments cut) and in inline code."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            for part in line.split("#")[0].split("&&"):
                if part.strip().startswith("nanguard "):
                    found.append(part.strip())
    found += re.findall(r"`(nanguard [^`]+)`", README)
    return sorted(set(found))


@pytest.mark.parametrize("command", _nanguard_commands())
def test_every_nanguard_command_parses(command: str) -> None:
    from lightning_nanguard.cli import build_parser

    argv = command.split()[1:]
    if argv == ["--version"]:
        return
    build_parser().parse_args(argv)  # an unknown command or option exits with status 2


def test_every_file_the_readme_names_exists() -> None:
    names = set(re.findall(r"\b((?:examples|benchmarks|docs|tests|lightning_nanguard|\.ci)/[\w./*-]+)", README))
    missing = [n for n in sorted(names) if not glob.glob(os.path.join(ROOT, n.rstrip(".")))]
    assert not missing, f"README names files that do not exist: {missing}"


def test_the_demo_incidents_listed_are_the_demo_tasks() -> None:
    from lightning_nanguard.demo import task_names

    sentence = README[README.index("`nanguard demo` trains") :].split("\n\n")[0]
    listed = set(re.findall(r"`(?:--incident )?([a-z0-9]+(?:-[a-z0-9]+)+)`", sentence))
    assert listed == set(task_names())
