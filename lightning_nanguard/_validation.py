"""Constructor-argument checks that name the argument, its value and the rule."""

from __future__ import annotations

import numbers
from collections.abc import Collection
from typing import Any

from lightning_nanguard.exceptions import NanGuardConfigError


def _fail(owner: str, name: str, value: Any, rule: str) -> NanGuardConfigError:
    return NanGuardConfigError(f"{owner}({name}={value!r}): {rule}.")


def check_choice(owner: str, name: str, value: Any, choices: Collection[Any]) -> None:
    if value not in choices:
        raise _fail(owner, name, value, f"must be one of {sorted(choices)!r}")


def check_int(owner: str, name: str, value: Any, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # numbers.Integral: Python and numpy integers alike (a YAML or numpy-built config passes either).
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "an int" + (" or None" if allow_none else "")
        raise _fail(owner, name, value, f"must be {kind} >= {minimum}")


def check_float(
    owner: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # rejects NaN
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high if high_inclusive else value < high
    if not ok:
        lo = "" if low is None else ("[" if low_inclusive else "(") + repr(low)
        hi = "" if high is None else repr(high) + ("]" if high_inclusive else ")")
        span = f" in {lo or '(-inf'}, {hi or 'inf)'}" if (low is not None or high is not None) else ""
        raise _fail(owner, name, value, f"must be a number{span}" + (" or None" if allow_none else ""))


def check_path(owner: str, name: str, value: Any, *, must_exist: bool = False, directory: bool = False) -> None:
    """A path given as ``str`` or ``os.PathLike`` (``None`` allowed); optionally one that exists."""
    import os

    if value is None:
        return
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise _fail(owner, name, value, "must be a path (str or os.PathLike) or None")
    if must_exist:
        exists = os.path.isdir(value) if directory else os.path.exists(value)
        if not exists:
            kind = "an existing directory" if directory else "an existing file"
            raise _fail(owner, name, value, f"must be {kind}")
