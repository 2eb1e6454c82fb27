"""The documentation site covers the public surface: every public name has a docstring and a place in the API
reference, every CLI command its help, every page its place in the nav, every generated table its rows.

Offline and without mkdocs: the pages are read as text and the generators of tools/docs_site.py (mkdocs.yml's hook)
are called directly; CI's `mkdocs build --strict` renders them.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib
import importlib.util
import inspect
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

import lightning_nanguard
import lightning_nanguard.callbacks
from lightning_nanguard import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SITE = _tool("docs_site")
GRIFFE = _tool("docs_griffe")


def _read(page: str) -> str:
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        return f.read()


def _nav_pages(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(value) for value in nav.values()))
    return set()


def test_every_public_name_has_a_docstring_and_is_in_the_api_reference() -> None:
    names = SITE.public_names()
    assert {"lightning_nanguard.GradNormMonitor", "lightning_nanguard.testing.FaultInjector"} <= set(names)
    assert len(names) == len(lightning_nanguard.__all__) + len(testing.__all__)
    assert SITE.undocumented(DOCS) == []


def test_a_missing_docstring_or_reference_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "api.md").write_text("::: lightning_nanguard.GradNormMonitor\n", encoding="utf-8")
    problems = SITE.undocumented(str(tmp_path))
    assert "lightning_nanguard.AutoRollback is in no '::: lightning_nanguard.AutoRollback' line" in " ".join(problems)
    assert not any("GradNormMonitor" in p for p in problems)
    monkeypatch.setattr(lightning_nanguard.GradNormMonitor, "__doc__", None)
    assert "lightning_nanguard.GradNormMonitor has no docstring" in SITE.undocumented(str(tmp_path))


def test_every_rendered_name_exists() -> None:
    for ident in sorted({i for p in _pages() for i in SITE.DIRECTIVE.findall(_read(p))}):
        module_name, _, attr = ident.rpartition(".")
        assert hasattr(importlib.import_module(module_name), attr), f"'::: {ident}' names nothing"


def test_every_cli_command_has_help_and_a_section() -> None:
    commands = SITE.commands()
    assert {"report", "verify", "demo", "ablate", "replay"} <= set(commands)
    for name, parser in commands.items():
        assert (parser.description or "").strip(), f"nanguard {name}: no description"
    reference = SITE.cli_reference()
    for name in commands:
        title = f"## nanguard {name}".rstrip()
        assert f"{title}\n" in reference, f"nanguard {name}: no section in the CLI page"
    assert "<!-- generated: cli -->" in _read("cli.md")


def _pages() -> list[str]:
    return sorted(os.path.relpath(p, DOCS) for p in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    nav = _nav_pages(config["nav"])
    assert set(_pages()) == nav


def test_causes_table_has_every_cause_and_remedy() -> None:
    from lightning_nanguard.contract import Cause
    from lightning_nanguard.policies.causes import CAUSES, EVIDENCE, Remedy

    assert set(SITE.remedy_wording()) == set(Remedy)
    rows = SITE.causes_table().splitlines()[2:]
    assert [re.match(r"\| `(\w+)` \|", row).group(1) for row in rows] == [c.value for c in CAUSES]  # type: ignore[union-attr]
    assert set(CAUSES) == set(Cause)
    hints = SITE.hints_table().splitlines()[2:]
    assert [re.match(r"\| `(\w+)` \|", row).group(1) for row in hints] == [c.value for c in CAUSES]  # type: ignore[union-attr]
    evidence = SITE.evidence_table().splitlines()[2:]
    assert len(evidence) == len(EVIDENCE)
    assert all(not row.endswith("| - |") for row in evidence), "an evidence rule without a docstring"


def test_every_marker_names_a_part() -> None:
    used = {name for page in _pages() for name in SITE.MARKER.findall(_read(page))}
    assert used == set(SITE.PARTS)
    with pytest.raises(ValueError, match="unknown generated part"):
        SITE.expand("<!-- generated: nothing -->")


def test_python_examples_on_the_pages_parse() -> None:
    for page in _pages():
        for block in re.findall(r"```python\n(.*?)```", _read(page), flags=re.S):
            ast.parse(block)


@pytest.mark.parametrize("callback", sorted(lightning_nanguard.callbacks.__all__))
def test_logged_keys_become_a_table(callback: str) -> None:
    doc = inspect.cleandoc(getattr(lightning_nanguard, callback).__doc__)
    keys = re.findall(r"^ +(``nanguard/[^ ]+``(?:, ``[^ ]+``)*)  ", doc, flags=re.MULTILINE)
    assert keys, f"{callback}'s docstring lists no logged key"
    table = GRIFFE.logged_keys_table(doc)
    rows = re.findall(r"^\| (``nanguard/.*?``|``.*?``, ``.*?``) \| (.+) \|$", table, flags=re.MULTILINE)
    assert [key for key, _ in rows] == keys
    assert all(text.strip() for _, text in rows)
    assert "Raises:" in table  # the sections after the block are untouched


def _prose(text: str) -> str:
    """A page without what may hold a ``#`` or a number legitimately: code blocks, inline code, link targets, URLs."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"https?://\S+", "", text)


PAST_WORK = [
    r"(?<![\w&/])#\d+\b",  # an issue or pull-request number
    r"\b[Ii]ssues? \d+",
    r"\bbefore this change\b",
    r"\bthis session\b",
    r"\b[Rr]ound \d+\b",
    r"\bstop \d+\b",
    r"\bwas \d+(\.\d+)?x\b",
]
DATED_HEADING = re.compile(r"^#+ .*(\b20\d\d-\d\d-\d\d\b|\b\d\d?:\d\d UTC\b|\b[Ss]ession\b|\b[Aa]fter the\b)", re.M)


@pytest.mark.parametrize("page", _pages())
def test_the_pages_state_what_holds_now(page: str) -> None:
    text = _read(page)
    prose = _prose(text)
    found = [m.group(0) for pattern in PAST_WORK for m in re.finditer(pattern, prose)]
    assert not found, f"{page} refers to issues or past work: {found} (the history belongs in CHANGELOG.md)"
    dated = DATED_HEADING.findall(text)
    assert not dated, f"{page} has dated headings of past work: {dated}"


def test_past_work_is_recognised() -> None:
    page = "# Title\n\n## Session of 2026-11-24\n\nFixed in #24 (issue 23): was 1.55x before this change.\n"
    found = [m.group(0) for pattern in PAST_WORK for m in re.finditer(pattern, _prose(page))]
    assert found == ["#24", "issue 23", "before this change", "was 1.55x"]
    assert DATED_HEADING.search(page)
    assert not [p for p in PAST_WORK if re.search(p, _prose("See `#24` and [x](PAGE.md#issue-2) at https://x.org/#3"))]


@pytest.mark.parametrize("callback", sorted(lightning_nanguard.callbacks.__all__))
def test_arguments_table_comes_from_the_configuration(callback: str) -> None:
    from lightning_nanguard.config import CONFIGS

    signature = inspect.signature(getattr(lightning_nanguard, callback))
    table = SITE.arguments_table(callback)
    rows = re.findall(r"^\| `(\w+)` \| `(.*?)` \| (.+?) \| (.+) \|$", table, flags=re.MULTILINE)
    assert [name for name, *_ in rows] == list(signature.parameters)
    for name, default, accepts, text in rows:
        assert default == repr(signature.parameters[name].default), name
        assert accepts.strip(), name
        assert text.strip(), name
    part = f"arguments-{SITE._kebab(callback)}"
    assert SITE.expand(f"<!-- generated: {part} -->") == table
    pages = [p for p in _pages() if f"::: lightning_nanguard.{callback}\n" in _read(p)]
    assert pages
    assert f"<!-- generated: {part} -->" in _read(pages[0])
    # The declaration is the documentation: a changed doc changes the table.
    field = next(f for f in dataclasses.fields(CONFIGS[callback]) if f.name == rows[0][0])
    assert " ".join(str(field.metadata["doc"]).split()).replace("|", "\\|") == rows[0][3]


def test_the_cli_page_shows_placeholders_as_written() -> None:
    """``<log_dir>`` in a command's description reads as text on the CLI page, not as an HTML tag the browser hides."""
    reference = SITE.cli_reference()
    assert "&lt;log_dir&gt;" in reference
    prose = "\n".join(line for line in reference.splitlines() if not line.startswith(("```", "nanguard ", "usage:")))
    assert "<log_dir>" not in prose.replace("`<log_dir>`", "")
