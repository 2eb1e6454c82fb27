"""Conflicting configuration is refused at construction, from one table (``_validation.CONFLICTS``), for every
constructor: the seven callbacks and ``default_callbacks``.

Each rule of the table is built with its example and must be refused with ``NanGuardConfigError`` naming every
argument involved, its value and the rule; the same arguments with any one of them back at its default must not meet
that rule. Every float argument of every constructor refuses NaN and the infinities (``bundle_mb=float("inf")`` was
accepted and then no bundle was ever written). Regressions of issue 30: ``OptimizerBackoff(skips_before_backoff=10,
skip_window=5)`` was accepted, and its skip trigger could never fire.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest

from lightning_nanguard import NanGuardConfigError, OptimizerBackoff, default_callbacks
from lightning_nanguard._validation import CONFLICTS, Conflict
from lightning_nanguard.preset import CALLBACKS

CONSTRUCTORS: dict[str, Any] = {cls.__name__: cls for cls in CALLBACKS} | {"default_callbacks": default_callbacks}
RULES = [(kind, conflict) for kind, conflicts in CONFLICTS.items() for conflict in conflicts]


def _value(kind: str, example: dict[str, Any], name: str) -> Any:
    """The value of ``name`` (a dotted callback argument, or a callback's presence, for ``default_callbacks``)."""
    if kind != "default_callbacks":
        return example[name]
    owner, _, argument = name.partition(".")
    return example.get(owner, {}).get(argument) if argument else example.get(owner, True) is not False


def _default(kind: str, name: str) -> Any:
    if kind == "default_callbacks":
        return None
    return inspect.signature(CONSTRUCTORS[kind]).parameters[name].default


def test_the_table_covers_every_constructor() -> None:
    assert set(CONFLICTS) == set(CONSTRUCTORS)
    for kind, constructor in CONSTRUCTORS.items():
        constructor()  # the defaults never conflict
        for conflict in CONFLICTS[kind]:
            assert conflict.args, conflict
            if kind != "default_callbacks":
                assert set(conflict.args) <= set(inspect.signature(constructor).parameters), conflict


@pytest.mark.parametrize(("kind", "conflict"), RULES, ids=[f"{k}:{'+'.join(c.args)}" for k, c in RULES])
def test_a_conflict_is_refused_naming_every_argument_its_value_and_the_rule(kind: str, conflict: Conflict) -> None:
    with pytest.raises(NanGuardConfigError) as raised:
        CONSTRUCTORS[kind](**conflict.example)
    message = str(raised.value)
    assert message.startswith(f"{kind}(")
    for name in conflict.args:
        assert f"{name}={_value(kind, conflict.example, name)!r}" in message
    assert conflict.rule in message


@pytest.mark.parametrize(("kind", "conflict"), RULES, ids=[f"{k}:{'+'.join(c.args)}" for k, c in RULES])
def test_the_rule_is_about_the_combination(kind: str, conflict: Conflict) -> None:
    # Some argument of the example, back at its default (a callback left out, installed again), leaves no conflict.
    resolved = []
    for name, value in conflict.example.items():
        if kind == "default_callbacks":
            if value is not False:
                continue
            changed = {**conflict.example, name: True}
        else:
            changed = {**conflict.example, name: _default(kind, name)}
        try:
            CONSTRUCTORS[kind](**changed)
        except NanGuardConfigError as err:
            if conflict.rule in str(err):
                continue
        resolved.append(name)
    assert resolved, conflict


def _float_arguments() -> list[tuple[str, str]]:
    return [
        (cls.__name__, name)
        for cls in CALLBACKS
        for name, parameter in inspect.signature(cls).parameters.items()
        if "float" in str(parameter.annotation)
    ]


@pytest.mark.parametrize(("owner", "name"), _float_arguments())
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_float_argument_refuses_a_non_finite_value(owner: str, name: str, value: float) -> None:
    with pytest.raises(NanGuardConfigError, match=rf"{owner}\({name}={value!r}\): must be a number"):
        CONSTRUCTORS[owner](**{name: value})
    with pytest.raises(NanGuardConfigError, match=rf"{owner}\({name}={value!r}\)"):
        default_callbacks(**{owner: {name: value}})


def test_an_oversized_bundle_budget_is_refused() -> None:
    with pytest.raises(NanGuardConfigError, match=r"GradNormMonitor\(bundle_mb=1e\+300\): must be a number in"):
        default_callbacks(GradNormMonitor={"bundle_mb": 1e300})


def test_skips_before_backoff_over_skip_window_is_refused() -> None:
    with pytest.raises(
        NanGuardConfigError,
        match=r"OptimizerBackoff\(skips_before_backoff=10, skip_window=5\): .*must be at most skip_window",
    ):
        OptimizerBackoff(skips_before_backoff=10, skip_window=5)
    assert OptimizerBackoff(skips_before_backoff=5, skip_window=5).skip_window == 5
