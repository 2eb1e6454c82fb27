"""A griffe extension for the documentation site: a docstring's "Logged keys" block becomes a table.

The callbacks' docstrings list the keys they log as aligned columns (the key, two or more spaces, what it holds;
a longer description goes on below, indented to its column), which reads well in the source and in ``help()`` but
runs into one paragraph in Markdown. mkdocs.yml loads this file as an extension of mkdocstrings' Python handler:
each class's docstring gets the block as a Markdown table before it is parsed. ``logged_keys_table`` is the whole
transformation (tests/test_docs_site.py calls it without griffe).
"""

from __future__ import annotations

import re
from typing import Any

HEADER = re.compile(r"^Logged keys(?P<note>.*):$")


def _row(key: str, text: str) -> str:
    cell = " ".join(text.split()).replace("|", "\\|")
    return f"| {key.replace('|', chr(92) + '|')} | {cell} |"


def logged_keys_table(doc: str) -> str:
    """Each "Logged keys[ (note)]:" block of a cleaned docstring as a Markdown table; the rest unchanged."""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        header = HEADER.match(lines[i])
        if header is None:
            out.append(lines[i])
            i += 1
            continue
        i += 1
        rows: list[list[str]] = []
        column = None
        while i < len(lines) and lines[i].startswith(" ") and lines[i].strip():
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            column = indent if column is None else column
            if indent == column or not rows:
                key, text = [*re.split(r"\s{2,}", line.strip(), maxsplit=1), ""][:2]
                rows.append([key, text])
            else:
                rows[-1][1] += " " + line.strip()
            i += 1
        note = header.group("note").strip()
        out += [f"**Logged keys** {note}".rstrip() + ":", "", "| key | what it holds |", "|---|---|"]
        out += [_row(key, text) for key, text in rows]
        out.append("")
    return "\n".join(out)


try:
    import griffe
except ImportError:  # the tests read logged_keys_table without griffe
    pass
else:

    class LoggedKeysTable(griffe.Extension):  # type: ignore[misc]
        """Rewrites each class docstring's "Logged keys" block as a table before the docstring is parsed."""

        def on_class_instance(self, *, cls: Any, **kwargs: Any) -> None:
            if cls.docstring is not None and "Logged keys" in cls.docstring.value:
                cls.docstring.value = logged_keys_table(cls.docstring.value)
