"""How a callback's arguments are declared: one frozen dataclass per callback whose fields carry the default, the
rule and the documentation of each argument, validated once at construction.

A field is declared with ``arg(default, rule, doc)``. ``CallbackConfig.__post_init__`` checks every field against its
rule (in declaration order), then the conflicts of ``lightning_nanguard._validation.CONFLICTS`` for the callback, then
the callback's own cross-argument rules (``_check_together``), and last normalises the values (a float argument is a
``float``, a path a ``str``). Every refusal is a ``NanGuardConfigError`` naming the owner, the argument, its value and
the rule. The docs site's argument tables are made from the same fields (``argument_rows``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from lightning_nanguard._validation import check_choice, check_conflicts, check_float, check_int, check_path
from lightning_nanguard.exceptions import NanGuardConfigError, brief

__all__ = ["CallbackConfig", "Choice", "Custom", "Flag", "Float", "Int", "PathArg", "Rule", "arg", "argument_rows"]


class Rule:
    """What values an argument takes: ``check`` refuses any other, ``describe`` says it in words (for the docs)."""

    def check(self, owner: str, name: str, value: object) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def normalise(self, value: object) -> Any:
        return value


@dataclass(frozen=True)
class Choice(Rule):
    choices: tuple[Any, ...]

    def check(self, owner: str, name: str, value: object) -> None:
        check_choice(owner, name, value, self.choices)

    def describe(self) -> str:
        return "one of " + ", ".join(f"`{c!r}`" for c in self.choices)


@dataclass(frozen=True)
class Flag(Rule):
    """A bool. ``strict``: refuse ``0``/``1`` too (they compare equal to False/True but are not what a YAML bool
    reads as), with ``message`` as the rule."""

    strict: bool = False
    message: str = "must be True or False (a bool)"

    def check(self, owner: str, name: str, value: object) -> None:
        if self.strict and not isinstance(value, bool):
            raise NanGuardConfigError(f"{owner}({name}={brief(value)}): {self.message}.")
        check_choice(owner, name, value, (True, False))

    def describe(self) -> str:
        return "`True` or `False`"


@dataclass(frozen=True)
class Int(Rule):
    minimum: int
    allow_none: bool = False

    def check(self, owner: str, name: str, value: object) -> None:
        check_int(owner, name, value, minimum=self.minimum, allow_none=self.allow_none)

    def describe(self) -> str:
        return f"int >= {self.minimum}" + (", or `None`" if self.allow_none else "")


@dataclass(frozen=True)
class Float(Rule):
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    allow_none: bool = False

    def check(self, owner: str, name: str, value: object) -> None:
        check_float(
            owner,
            name,
            value,
            low=self.low,
            high=self.high,
            low_inclusive=self.low_inclusive,
            high_inclusive=self.high_inclusive,
            allow_none=self.allow_none,
        )

    def describe(self) -> str:
        if self.low is None and self.high is None:
            span = ""
        else:
            lo = "(-inf" if self.low is None else ("[" if self.low_inclusive else "(") + f"{self.low:g}"
            hi = "inf)" if self.high is None else f"{self.high:g}" + ("]" if self.high_inclusive else ")")
            span = f" in {lo}, {hi}"
        return f"finite number{span}" + (", or `None`" if self.allow_none else "")

    def normalise(self, value: Any) -> Any:
        return None if value is None else float(value)


@dataclass(frozen=True)
class PathArg(Rule):
    must_exist: bool = False
    directory: bool = False

    def check(self, owner: str, name: str, value: object) -> None:
        check_path(owner, name, value, must_exist=self.must_exist, directory=self.directory)

    def describe(self) -> str:
        kind = ("an existing directory" if self.directory else "an existing file") if self.must_exist else "a path"
        return f"{kind} (`str` or `os.PathLike`), or `None`"

    def normalise(self, value: Any) -> Any:
        return None if value is None else os.fspath(value)


@dataclass(frozen=True)
class Custom(Rule):
    """A rule of its own: ``checker(owner, name, value)`` raises ``NanGuardConfigError``; ``text`` describes it."""

    checker: Callable[[str, str, Any], None]
    text: str
    normaliser: Callable[[Any], Any] | None = None

    def check(self, owner: str, name: str, value: object) -> None:
        self.checker(owner, name, value)

    def describe(self) -> str:
        return self.text

    def normalise(self, value: object) -> Any:
        return value if self.normaliser is None else self.normaliser(value)


def arg(default: object, rule: Rule, doc: str) -> Any:
    """An argument: its default, its rule and its documentation (a sentence or a few, Markdown)."""
    return field(default=default, metadata={"rule": rule, "doc": " ".join(doc.split())})


@dataclass(frozen=True)
class CallbackConfig:
    """The arguments of one callback, validated once. ``owner``: the name refusals and notices use (the callback's
    class, a subclass's name where it is one)."""

    kind: ClassVar[str] = ""  # the callback's name: its key in ``CONFLICTS``
    owner: str = field(default="", kw_only=True, compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        owner = self.owner or self.kind
        object.__setattr__(self, "owner", owner)
        fields = _arguments(type(self))
        values = {f.name: getattr(self, f.name) for f in fields}
        for f in fields:
            f.metadata["rule"].check(owner, f.name, values[f.name])
        check_conflicts(self.kind, owner, values)
        self._check_together(owner)
        for f in fields:
            object.__setattr__(self, f.name, f.metadata["rule"].normalise(values[f.name]))

    def _check_together(self, owner: str) -> None:
        """Cross-argument rules that are not a ``Conflict`` (a message of their own)."""

    @classmethod
    def from_arguments(cls, owner: str, values: dict[str, Any]) -> Any:
        """The configuration of the arguments among ``values`` (a constructor's ``locals()``).

        A refusal's traceback starts here, under the callback's constructor: the frames of the rules that found it
        (the dataclass, the rule, the check) add nothing to its message, and LightningCLI prints every frame of an
        error in a config file."""
        try:
            return cls(owner=owner, **{f.name: values[f.name] for f in _arguments(cls)})
        except NanGuardConfigError as err:
            raise err.with_traceback(None) from err.__cause__


def arguments_docstring(cls: type) -> str:
    """The Google-style ``Args:`` section of a configuration's arguments (for ``help()`` and LightningCLI's help)."""
    lines = ["Args:"]
    for name, _, rule, doc in argument_rows(cls):
        lines.append(f"    {name}: {doc} Accepts {rule}.".replace("`", "``"))
    return "\n".join(lines)


_C = TypeVar("_C", bound=type)


def arguments_from(config: type[CallbackConfig]) -> Callable[[_C], _C]:
    """Class decorator: the callback's docstring gets its arguments' ``Args:`` section from ``config`` (before its
    "Logged keys"), so they are written once, in the configuration."""

    def decorate(callback: _C) -> _C:
        doc = callback.__doc__ or ""
        section = "\n".join("    " + line for line in arguments_docstring(config).splitlines())
        at = doc.find("\n    Logged keys")
        callback.__doc__ = doc + "\n\n" + section if at < 0 else doc[:at] + "\n" + section + "\n" + doc[at:]
        return callback

    return decorate


class Configured:
    """A callback whose arguments are one configuration (``config``): each argument reads as an attribute of the
    callback (``monitor.spike_zscore``), from that configuration, never from a copy."""

    config: CallbackConfig

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and name in config.__dataclass_fields__ and name != "owner":
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _arguments(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if "rule" in f.metadata]


def argument_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """Each argument of a configuration: its name, its default (as Python writes it), its rule, its documentation."""
    return [(f.name, repr(f.default), f.metadata["rule"].describe(), f.metadata["doc"]) for f in _arguments(cls)]
