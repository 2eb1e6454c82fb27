"""Constructor-argument checks that name the argument, its value and the rule; and the one table of the
combinations of arguments that conflict (``CONFLICTS``), refused at construction naming every argument involved."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.exceptions import NanGuardConfigError, brief


def _fail(owner: str, name: str, value: object, rule: str) -> NanGuardConfigError:
    return NanGuardConfigError(f"{owner}({name}={brief(value)}): {rule}.")


def check_choice(owner: str, name: str, value: object, choices: Collection[Any]) -> None:
    if value not in choices:
        raise _fail(owner, name, value, f"must be one of {sorted(choices)!r}")


def check_int(owner: str, name: str, value: object, *, minimum: int, allow_none: bool = False) -> None:
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
    # Finite only (NaN and infinities refused): every float argument is a size, a rate or a threshold, and None
    # (where allowed) is how "no limit" is said.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high if high_inclusive else value < high
    if not ok:
        lo = "" if low is None else ("[" if low_inclusive else "(") + repr(low)
        hi = "" if high is None else repr(high) + ("]" if high_inclusive else ")")
        span = f" in {lo or '(-inf'}, {hi or 'inf)'}" if (low is not None or high is not None) else ""
        raise _fail(owner, name, value, f"must be a number{span}" + (" or None" if allow_none else ""))


def check_path(owner: str, name: str, value: object, *, must_exist: bool = False, directory: bool = False) -> None:
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


@dataclass(frozen=True)
class Conflict:
    """Arguments whose values together cannot do what they ask (a rule that can never fire, a setting another one
    turns off): refused at construction with every one of them, its value, and the rule.

    ``clash`` takes the values of ``args`` in order. ``example``: arguments that clash, for the table-driven test to
    build the constructor with (for ``default_callbacks``, its keyword arguments).
    """

    args: tuple[str, ...]
    clash: Callable[..., bool]
    rule: str
    example: dict[str, Any] = field(default_factory=dict)


# Every conflict, by constructor. A dotted name (``"GradNormMonitor.on_spike"``) is an argument of a callback that
# ``default_callbacks`` builds; a plain class name there, whether that callback is installed.
CONFLICTS: dict[str, tuple[Conflict, ...]] = {
    "GradNormMonitor": (
        Conflict(
            ("on_spike", "spike_zscore"),
            lambda on_spike, zscore: on_spike != "warn" and zscore is None,
            "on_spike acts on a detected spike, and spike_zscore=None detects none: set spike_zscore (e.g. 6.0)",
            {"on_spike": "skip", "spike_zscore": None},
        ),
        Conflict(
            ("quarantine_file", "quarantine"),
            lambda path, quarantine: path is not None and not quarantine,
            "a quarantine file seeds the quarantine, which quarantine=False turns off: drop one of them",
            {"quarantine_file": __file__, "quarantine": False},
        ),
        Conflict(
            ("on_dropped_budget", "max_dropped_fraction"),
            lambda on_budget, fraction: on_budget != "stop" and fraction is None,
            "on_dropped_budget says what happens when the dropped-updates budget is crossed, and "
            "max_dropped_fraction=None sets no budget: set a fraction (e.g. 0.05)",
            {"on_dropped_budget": "warn", "max_dropped_fraction": None},
        ),
        Conflict(
            ("log_every_n_steps", "layer_depth", "histogram"),
            lambda every, depth, histogram: every is not None and depth is None and not histogram,
            "log_every_n_steps paces the per-layer norms (and the histogram), which layer_depth=None and "
            "histogram=False turn off: set a layer_depth, or leave log_every_n_steps unset",
            {"log_every_n_steps": 5, "layer_depth": None, "histogram": False},
        ),
    ),
    "AutoRollback": (
        Conflict(
            ("num_snapshots", "source"),
            lambda n, source: source == "memory" and n == 0,
            "source='memory' restores from snapshots in memory and needs at least one: num_snapshots >= 1",
            {"num_snapshots": 0, "source": "memory"},
        ),
        Conflict(
            ("max_rollbacks", "rollback_window"),
            lambda budget, window: budget >= window,
            "the budget allows max_rollbacks within rollback_window steps, at most one per step, so it could never "
            "be exceeded: max_rollbacks must be below rollback_window",
            {"max_rollbacks": 10, "rollback_window": 10},
        ),
        Conflict(
            ("max_snapshot_bytes", "source"),
            lambda limit, source: limit is not None and source == "disk",
            "max_snapshot_bytes limits the snapshots kept in memory, and source='disk' keeps none",
            {"max_snapshot_bytes": 2**20, "source": "disk"},
        ),
    ),
    "OptimizerBackoff": (
        Conflict(
            ("skips_before_backoff", "skip_window"),
            lambda count, window: count > window,
            "that many dropped updates can never happen within skip_window steps (one per step at most), so the "
            "skip trigger would never lower the learning rate: skips_before_backoff must be at most skip_window",
            {"skips_before_backoff": 10, "skip_window": 5},
        ),
        Conflict(
            ("recover_steps", "recover_after"),
            lambda steps, after: steps != 1 and after is None,
            "recover_steps paces the recovery that recover_after turns on, and recover_after=None never recovers: "
            "set recover_after, or leave recover_steps at 1",
            {"recover_steps": 4, "recover_after": None},
        ),
        Conflict(
            ("safe_eps", "max_eps", "on_hazard"),
            lambda safe, cap, on_hazard: on_hazard == "fix" and safe > cap,
            "on_hazard='fix' raises an underflowing eps to safe_eps, above max_eps, the cap of every eps backoff: "
            "safe_eps must be at most max_eps",
            {"safe_eps": 0.1, "max_eps": 0.01, "on_hazard": "fix"},
        ),
    ),
    "LossScaleWatchdog": (
        Conflict(
            ("max_scale", "min_scale"),
            lambda cap, floor: cap is not None and cap < floor,
            "the cap is below the floor: max_scale must be >= min_scale, or None",
            {"max_scale": 0.5, "min_scale": 1.0},
        ),
        Conflict(
            ("on_collapse", "floor_patience", "max_overflow_streak"),
            lambda on_collapse, patience, streak: on_collapse != "auto" and patience is None and streak is None,
            "on_collapse says what a collapse does, and with both collapse rules off (None) none is ever found: set "
            "floor_patience or max_overflow_streak",
            {"on_collapse": "stop", "floor_patience": None, "max_overflow_streak": None},
        ),
        Conflict(
            ("on_collapse", "max_collapses"),
            lambda on_collapse, budget: on_collapse == "warn" and budget == 0,
            "on_collapse='warn' goes on after a collapse, and max_collapses=0 stops at the first: raise "
            "max_collapses, or use on_collapse='stop'",
            {"on_collapse": "warn", "max_collapses": 0},
        ),
    ),
    "CheckpointGuard": (),
    "FP32Evaluation": (),
    "PrecisionHeadroom": (),
    "default_callbacks": (
        Conflict(
            ("GradNormMonitor.on_spike", "AutoRollback"),
            lambda on_spike, rollback: on_spike == "rollback" and not rollback,
            "a spike is handed to AutoRollback, which is left out: keep AutoRollback, or use on_spike='skip'",
            {"GradNormMonitor": {"spike_zscore": 6.0, "on_spike": "rollback"}, "AutoRollback": False},
        ),
        Conflict(
            ("LossScaleWatchdog.on_collapse", "AutoRollback"),
            lambda on_collapse, rollback: on_collapse == "rollback" and not rollback,
            "a collapse is handed to AutoRollback, which is left out: keep AutoRollback, or use on_collapse='auto'",
            {"LossScaleWatchdog": {"on_collapse": "rollback"}, "AutoRollback": False},
        ),
    ),
}


def check_conflicts(kind: str, owner: str, values: Mapping[str, Any]) -> None:
    """Refuse the first of ``CONFLICTS[kind]`` that ``values`` (every argument by name) meet: ``NanGuardConfigError``
    naming ``owner``, the arguments involved with their values, and the rule."""
    for conflict in CONFLICTS[kind]:
        if conflict.clash(*(values[name] for name in conflict.args)):
            shown = ", ".join(f"{name}={brief(values[name])}" for name in conflict.args)
            raise NanGuardConfigError(f"{owner}({shown}): {conflict.rule}.")
