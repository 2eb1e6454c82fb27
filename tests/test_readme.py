"""The README and the documentation pages tell the truth: every command they show parses, every file they name
exists, every default a callback page shows is the constructor's real default, and every logged key and incident
action is documented."""

from __future__ import annotations

import argparse
import ast
import glob
import inspect
import os
import re

import pytest

import lightning_nanguard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


README = _read("README.md")
PAGES = {
    os.path.relpath(p, ROOT): _read(os.path.relpath(p, ROOT))
    for p in sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
}
CALLBACK_PAGES = {k: v for k, v in PAGES.items() if k.startswith(os.path.join("docs", "callbacks"))}
DOCS = "\n".join(PAGES.values())


def _calls() -> list[tuple[str, ast.Call]]:
    """The signature blocks of the callback pages, e.g. "GradNormMonitor(\\n    on_nonfinite=...,\\n)"."""
    calls = []
    for text in CALLBACK_PAGES.values():
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            stripped = block.strip()
            if not re.match(r"^[A-Z]\w+\(", stripped):
                continue
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
        assert kw.arg in params, f"the docs show {name}({kw.arg}=...), which does not exist"
        assert ast.literal_eval(kw.value) == params[kw.arg].default, f"the docs' default of {name}({kw.arg}) is stale"


@pytest.mark.parametrize(("name", "call"), CALLS, ids=[n for n, _ in CALLS])
def test_every_constructor_argument_is_documented(name: str, call: ast.Call) -> None:
    params = set(inspect.signature(getattr(lightning_nanguard, name)).parameters)
    shown = {kw.arg for kw in call.keywords}
    assert params == shown, f"the docs' {name}(...) block misses {sorted(params - shown)}"


def test_every_logged_tag_is_documented() -> None:
    from lightning_nanguard.reporting import keys

    tags = [getattr(keys, k) for k in keys.__all__ if k.isupper() and k != "PREFIX"]
    missing = [t for t in tags if f"`{t}" not in DOCS]
    assert not missing, f"the docs do not mention {missing}"


def test_every_incident_action_is_documented() -> None:
    from lightning_nanguard.contract import Action

    missing = [a.value for a in Action if a is not Action.NONE and f"`{a.value}`" not in DOCS]
    assert not missing, f"the docs do not list the incident action(s) {missing}"


def _nanguard_commands(text: str) -> list[str]:
    """Every ``nanguard ...`` command a page shows: in bash blocks (comments cut) and in inline code."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in line.split("#")[0].split("&&"):
                part = part.strip().lstrip("(")
                if part.startswith("nanguard "):
                    found.append(part.rstrip(")").strip())
    found += re.findall(r"`(nanguard [^`]+)`", text)
    return sorted(set(found))


COMMANDS = sorted({c for text in [README, *PAGES.values()] for c in _nanguard_commands(text)})


def test_the_readme_shows_the_commands() -> None:
    assert {"nanguard demo", "nanguard report lightning_logs/version_0"} <= set(_nanguard_commands(README))
    assert "python -m pytest -q" in README  # what .ci/run runs
    assert "mkdocs build --strict" in README
    assert "python -m build" in README


@pytest.mark.parametrize("command", COMMANDS)
def test_every_nanguard_command_parses(command: str) -> None:
    from lightning_nanguard.cli import build_parser

    argv = command.split()[1:]
    if argv == ["--version"] or "<command>" in argv:
        return  # "nanguard <command> --help" stands for every command, each parsed on its own
    parser = build_parser()
    if any(not a.startswith("-") for a in argv[1:]):
        parser.parse_args(argv)  # an unknown command or option exits with status 2
        return
    # A command named with its options but without its arguments ("nanguard verify --write-sidecar")
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert argv[0] in subparsers.choices, f"{command}: no such command"
    options = subparsers.choices[argv[0]]._option_string_actions
    assert all(a.split("=")[0] in options for a in argv[1:]), f"{command}: no such option"


FILES = re.compile(r"(?<![\w/.-])((?:examples|benchmarks|docs|tests|tools|lightning_nanguard|\.ci)/[\w./*-]+)")


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_every_file_a_page_names_exists(page: str) -> None:
    text = README if page == "README.md" else PAGES[page]
    names = {n.rstrip(".") for n in FILES.findall(text) if "<" not in n}
    # a module's attribute (tests/sharded/_fsdp1_worker.CPUFSDPStrategy) names the module's file
    missing = [
        n
        for n in sorted(names)
        if not glob.glob(os.path.join(ROOT, n)) and not os.path.exists(os.path.join(ROOT, n.rsplit(".", 1)[0] + ".py"))
    ]
    assert not missing, f"{page} names files that do not exist: {missing}"


def test_the_readme_links_into_the_site() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)", README)
    assert {"docs/index.md", "docs/callbacks/index.md", "docs/guide.md", "docs/decides.md"} <= set(links)
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing


def test_the_readme_stays_short() -> None:
    assert len(README.splitlines()) < 200


def test_the_demo_incidents_listed_are_the_demo_tasks() -> None:
    from lightning_nanguard.demo import task_names

    sentence = README[README.index("`nanguard demo` trains") :].split("\n\n")[0]
    listed = set(re.findall(r"`(?:--incident )?([a-z0-9]+(?:-[a-z0-9]+)+)`", sentence))
    assert listed == set(task_names())
