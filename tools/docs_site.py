"""The documentation site's generated parts: tables made from the code at build time, never copied into a page.

mkdocs.yml names this file under ``hooks:``. A page asks for a part with a marker on a line of its own,
``<!-- generated: NAME -->``, and ``on_page_markdown`` puts the part in its place; an unknown name fails the build.
The parts, in ``PARTS``:

* ``causes``: every cause of ``lightning_nanguard.policies.causes.CAUSES`` with its remedy, the data and the state.
* ``hints``: what an incident of each cause tells you to try.
* ``evidence``: the evidence rules of ``EVIDENCE``, in the order they are tried, each with its docstring's summary.
* ``cli``: ``nanguard`` and each command's usage, description and arguments, from ``lightning_nanguard.cli.build_parser()``.
* ``arguments-<callback>`` (``arguments-grad-norm-monitor``, ...): a callback's arguments with their defaults, the
  values they accept and what they do, from its configuration type in ``lightning_nanguard.config``.

It also holds the API reference to the public surface (``on_files``): every name in the ``__all__`` of
``PUBLIC_MODULES`` has a docstring of its own and is rendered by a ``::: name`` line of a reference page
(``REFERENCE_PAGES``), or the build warns, and so ``mkdocs build --strict`` fails.

The functions need no mkdocs, so tests/test_docs_site.py calls them directly.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

# The tables come from this checkout's code, as mkdocstrings' pages do (mkdocs.yml: `paths: [.]`), whatever
# lightning_nanguard is installed.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MARKER = re.compile(r"^<!-- generated: ([a-z0-9-]+) -->$", re.MULTILINE)
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)  # mkdocstrings: render this object here
PUBLIC_MODULES = ("lightning_nanguard", "lightning_nanguard.testing")
# The API reference: its own page, and the callbacks' pages, where each callback's reference sits with its guide.
REFERENCE_PAGES = ("api.md", "callbacks/*.md")
log = logging.getLogger("mkdocs.hooks.docs_site")  # under "mkdocs": a warning here fails a --strict build
HELP_WIDTH = "110"  # argparse wraps help to $COLUMNS: a fixed width keeps the page the same on every machine


def _prose(text: str) -> str:
    """Plain text as Markdown: ``<log_dir>`` shown as written, not taken for an HTML tag (code spans left alone)."""
    parts = text.split("`")
    parts[::2] = [p.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts)


def _cell(text: str) -> str:
    """A table cell: one line, with the pipe escaped."""
    return " ".join(text.split()).replace("|", "\\|") or "-"


def _summary(func: Callable[..., Any]) -> str:
    """The first paragraph of a function's docstring."""
    doc = inspect.getdoc(func) or ""
    return doc.split("\n\n")[0]


def remedy_wording() -> dict[Any, str]:
    """What each remedy family does beyond dropping the update, in the words of the site."""
    from lightning_nanguard.policies.causes import Remedy

    return {
        Remedy.SKIP: "drop the update; nothing more",
        Remedy.RAISE_EPS: "drop the update, raise the optimizer's eps (OptimizerBackoff)",
        Remedy.PROMOTE_WHEN_RECURRING: "drop the update; once it recurs, run the module in float32 (FP32Evaluation)",
        Remedy.ROLLBACK_AND_BACKOFF: "restore a sound state (AutoRollback), lower the learning rate (OptimizerBackoff)",
        Remedy.RESTORE: "restore a sound state (AutoRollback; a verified checkpoint, CheckpointGuard)",
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def causes_table() -> str:
    """The causes and their remedies, one row per ``CauseSpec`` of the registry."""
    from lightning_nanguard.policies.causes import CAUSES, EVIDENCE

    wording = remedy_wording()
    rules: dict[Any, list[str]] = {}
    for number, rule in enumerate(EVIDENCE, 1):
        rules.setdefault(rule.cause, []).append(str(number))
    lines = [
        "| cause | what happened | remedy | data at fault | state trusted at once | evidence rules |",
        "|---|---|---|---|---|---|",
    ]
    for cause, spec in CAUSES.items():
        decided = ", ".join(rules.get(cause, [])) if spec.diagnosed else "none: named by the callback that saw it"
        lines.append(
            f"| `{cause.value}` | {_cell(spec.reason)} | {_cell(wording[spec.remedy])} | {_yes(spec.data_at_fault)} "
            f"| {_yes(spec.state_trusted)} | {decided} |"
        )
    return "\n".join(lines)


def hints_table() -> str:
    """What an incident of each cause tells you to try (its rule may write a more specific hint)."""
    from lightning_nanguard.policies.causes import CAUSES

    lines = ["| cause | what to try |", "|---|---|"]
    lines += [f"| `{cause.value}` | {_cell(spec.hint)} |" for cause, spec in CAUSES.items()]
    return "\n".join(lines)


def evidence_table() -> str:
    """The evidence rules in the order they are tried: the first that decides names the cause."""
    from lightning_nanguard.policies.causes import EVIDENCE

    lines = ["| rule | when | cause | evidence |", "|---|---|---|---|"]
    for number, rule in enumerate(EVIDENCE, 1):
        module = rule.decide.__module__.rsplit(".", 1)[-1]
        name = f"`{module}.{rule.decide.__name__}`"
        lines.append(
            f"| {number} {name} | {rule.stage.value} | `{rule.cause.value}` | {_cell(_summary(rule.decide))} |"
        )
    return "\n".join(lines)


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every ``nanguard`` command's parser, by name (``""``: the top-level parser)."""
    from lightning_nanguard.cli import build_parser

    parser = build_parser()
    found = {"": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _argument(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One argument's table row: its flags (or its name), what it does, with argparse's ``%(default)s`` expanded."""
    name = ", ".join(action.option_strings) or (action.metavar if isinstance(action.metavar, str) else action.dest)
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
        if action.choices is not None:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
        name = f"{name} {metavar}"
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return f"| `{name}` | {_prose(_cell(text))} |"


def cli_reference() -> str:
    """``nanguard`` and each of its commands: the usage, the description, a table of the arguments; the exit codes
    once (an epilog other than ``EXIT_CODES`` with its command)."""
    from lightning_nanguard.cli import EXIT_CODES

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parts = []
        for name, parser in commands().items():
            lines = [f"## nanguard {name}".rstrip(), "", "```text", parser.format_usage().strip(), "```", ""]
            lines += [
                _prose(" ".join((parser.description or "").split())),
                "",
                "| argument | what it does |",
                "|---|---|",
            ]
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    lines += [f"| `{sub.dest}` | {_prose(_cell(sub.help or ''))} |" for sub in action._choices_actions]
                elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                    lines.append(_argument(parser, action))
            if parser.epilog and (not name or parser.epilog != EXIT_CODES):
                intro = "Every command exits with these codes:" if parser.epilog == EXIT_CODES else ""
                lines += ["", intro, "", "```text", parser.epilog.strip(), "```"]
            parts.append("\n".join(lines))
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n\n".join(parts)


def arguments_table(callback: str) -> str:
    """A callback's arguments, from its configuration type (``lightning_nanguard.config.CONFIGS``): the name, the
    default, the values it accepts and what it does, in the order of its signature."""
    from lightning_nanguard.config import CONFIGS, argument_rows

    lines = ["| argument | default | accepts | what it does |", "|---|---|---|---|"]
    for name, default, rule, doc in argument_rows(CONFIGS[callback]):
        lines.append(f"| `{name}` | `{_cell(default)}` | {_cell(rule)} | {_cell(doc)} |")
    return "\n".join(lines)


def _kebab(name: str) -> str:
    """``GradNormMonitor`` -> ``grad-norm-monitor``; ``FP32Evaluation`` -> ``fp32-evaluation``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", name).lower()


def _arguments_parts() -> dict[str, Callable[[], str]]:
    from lightning_nanguard.config import CONFIGS

    return {f"arguments-{_kebab(name)}": functools.partial(arguments_table, name) for name in CONFIGS}


PARTS: dict[str, Callable[[], str]] = {
    "causes": causes_table,
    "hints": hints_table,
    "evidence": evidence_table,
    "cli": cli_reference,
    **_arguments_parts(),  # "arguments-grad-norm-monitor": each callback's page, its arguments
}


def public_names() -> dict[str, Any]:
    """Every public object by its documented path: the names in the ``__all__`` of ``PUBLIC_MODULES``."""
    modules = [importlib.import_module(name) for name in PUBLIC_MODULES]
    return {f"{m.__name__}.{name}": getattr(m, name) for m in modules for name in m.__all__}


def rendered(docs_dir: str) -> set[str]:
    """The objects the reference pages render (their ``::: name`` lines)."""
    found: set[str] = set()
    for pattern in REFERENCE_PAGES:
        for path in glob.glob(os.path.join(docs_dir, pattern)):
            with open(path, encoding="utf-8") as f:
                found.update(DIRECTIVE.findall(f.read()))
    return found


def undocumented(docs_dir: str) -> list[str]:
    """What the API reference misses: a public name without a docstring of its own, or not rendered."""
    shown = rendered(docs_dir)
    problems = []
    for path, obj in public_names().items():
        # A class's own docstring: inspect.getdoc would inherit its base's.
        doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        if not (doc or "").strip():
            problems.append(f"{path} has no docstring")
        if path not in shown:
            problems.append(f"{path} is in no '::: {path}' line of {', '.join(REFERENCE_PAGES)}")
    return problems


def on_files(files: Any, *, config: Any) -> Any:
    """mkdocs hook: warn for each public name the API reference misses."""
    for problem in undocumented(config["docs_dir"]):
        log.warning("API reference: %s", problem)
    return files


def expand(markdown: str) -> str:
    """Put each generated part in place of its marker."""

    def part(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in PARTS:
            raise ValueError(f"unknown generated part {name!r} (known: {', '.join(PARTS)})")
        return PARTS[name]()

    return MARKER.sub(part, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: expand the markers of every page."""
    return expand(markdown)
