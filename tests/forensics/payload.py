"""What a crafted bundle names: each callable writes the marker file it is given, so a test proves none of them ran.

Importing this module writes nothing (a bundle may name the LightningModule's module, which is then imported: that
is the one thing a bundle can make run, after the user is told which).
"""

from __future__ import annotations

from typing import Any


def touch(path: str, *args: Any, **kwargs: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("a crafted bundle ran code")


class Touch:
    """A class (not a LightningModule) whose constructor runs code."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        touch(path)


class Pickled:
    """Unpickled, it calls ``touch``: the classic pickle payload."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return touch, (self.path,)
