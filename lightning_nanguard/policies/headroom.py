"""The headroom forecast: which module to run in float32 before it overflows, and which may go back.

Pure: sampled abs-maxima in, decisions out (no Trainer, no tensor). ``HeadroomBook`` keeps a short history of each
module's output abs-max (``amax``), and of the worst half-precision op inside its forward (entry ``"<module> (ops)"``,
``signals.op_headroom``), with the limit each is measured against (the training precision's largest value); ``decide``
reads it, an op entry acting on its module:

======================================================  ==========================================================
what the history shows                                  decision
======================================================  ==========================================================
a module below ``margin_bits`` of headroom              promote it (every such module, the outermost first)
under ``watch_bits``, falling at every one of the last  promote it: the fitted trend reaches 0 bits within
``trend_samples`` samples                               ``horizon_steps`` (the closest one per sample)
the loss has risen ``DIVERGING_LOSS_RATIO`` times over  promote nothing: the whole run is diverging, float32 would
the same samples                                        only hide it (the incident path's rollback answers it)
a module the forecast promoted, ``watch_bits`` or more  demote it (unless it was promoted again after a demotion:
of would-be headroom for ``demote_after`` samples       then it stays in float32)
======================================================  ==========================================================

Under ``16-mixed`` the largest parameter gradient times the loss scale it ran with (the float16 value autocast's
backward wrote, ``loss-scaled gradient``) is sampled too; ``scale_cut`` says by how many powers of two to lower the
GradScaler's scale so that it has ``scale_margin_bits`` of headroom again (a power of two changes no value that
neither overflows nor underflows float16: the update is the same, only the overflow does not come).

A promoted module's output is float32; its headroom is still measured against the half-precision limit (what it
would have if it ran in half precision again), which is what its demotion is judged on. A non-finite abs-max is not
forecast (the overflow happened: the incident path handles it) and is not kept.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lightning_nanguard.signals.headroom import GRADIENT
from lightning_nanguard.signals.op_headroom import OPS, module_of

__all__ = [
    "DIVERGING_LOSS_RATIO",
    "Decision",
    "Forecast",
    "HeadroomBook",
    "HeadroomSettings",
    "ScaleLowerings",
    "decide",
    "forecast",
    "scale_cut",
]

DIVERGING_LOSS_RATIO = 2.0


@dataclass(frozen=True)
class HeadroomSettings:
    every_n_steps: int = 50
    margin_bits: float = 1.0
    watch_bits: float = 6.0
    horizon_steps: int = 200
    trend_samples: int = 3
    demote_after: int | None = 20
    history: int = 16
    max_promotions: int = 8
    scale_margin_bits: float | None = 4.0


@dataclass(frozen=True)
class Forecast:
    """One module's headroom now and where its trend goes.

    Attributes:
        bits: headroom at the last sample.
        slope: bits per step over the trend samples (least squares; 0 with fewer than two samples).
        steps_to_zero: steps until the trend reaches 0 bits (``inf`` when it does not fall).
        falling: the last ``trend_samples`` samples each fell.
    """

    bits: float
    slope: float
    steps_to_zero: float
    falling: bool


@dataclass
class HeadroomBook:
    """Each module's last samples: ``(step, amax, limit)``, and the loss at each sample."""

    size: int = 16
    modules: dict[str, deque[tuple[int, float, float]]] = field(default_factory=dict)
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=16))

    def add(self, step: int, name: str, amax: float, limit: float) -> None:
        if not math.isfinite(amax):
            return
        entries = self.modules.get(name)
        if entries is None:
            entries = self.modules[name] = deque(maxlen=self.size)
        if entries and entries[-1][0] == step:
            entries.pop()
        entries.append((step, amax, limit))

    def add_loss(self, step: int, loss: float | None) -> None:
        if loss is not None and math.isfinite(loss):
            self.losses.append((step, loss))

    def bits(self, name: str, limit: float | None = None) -> list[tuple[int, float]]:
        """``(step, headroom bits)`` of ``name``'s samples, against ``limit`` (each sample's own when ``None``)."""
        return [(s, math.log2((limit or lim) / max(a, 2.0**-24))) for s, a, lim in self.modules.get(name, ())]

    def latest(self, limit: float | None = None) -> dict[str, float]:
        """Each module's headroom at its last sample."""
        return {name: self.bits(name, limit)[-1][1] for name, entries in self.modules.items() if entries}

    def forget(self, module: str) -> None:
        """Drop the op entries of ``module`` and its submodules (demoted: their float32 history says nothing)."""
        for name in [n for n in self.modules if n.endswith(OPS) and _inside(module_of(n), {module})]:
            del self.modules[name]

    def rebase(self, limit: float) -> None:
        """Measure every sample against at most ``limit`` from now on (a float32 run resumed in float16: its
        history says how close the float16 limit is before the first half-precision step)."""
        for entries in self.modules.values():
            for i, (s, a, lim) in enumerate(entries):
                entries[i] = (s, a, min(lim, limit))

    def state_dict(self) -> dict[str, object]:
        return {
            "modules": {n: [list(e) for e in entries] for n, entries in self.modules.items()},
            "losses": [list(e) for e in self.losses],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.modules = {}
        for name, entries in dict(state.get("modules", {})).items():
            self.modules[str(name)] = deque(((int(s), float(a), float(lim)) for s, a, lim in entries), maxlen=self.size)
        self.losses = deque(((int(s), float(v)) for s, v in state.get("losses", [])), maxlen=self.size)


def forecast(samples: list[tuple[int, float]], trend_samples: int) -> Forecast:
    """The trend of the last ``trend_samples`` ``(step, bits)`` samples."""
    bits = samples[-1][1]
    recent = samples[-trend_samples:]
    if len(recent) < 2:
        return Forecast(bits, 0.0, math.inf, False)
    xs = [float(s) for s, _ in recent]
    ys = [b for _, b in recent]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    falling = len(recent) >= trend_samples and all(b < a for a, b in itertools.pairwise(ys))
    steps = bits / -slope if slope < 0 and bits > 0 else (0.0 if bits <= 0 else math.inf)
    return Forecast(bits, slope, steps, falling)


@dataclass(frozen=True)
class Decision:
    """What ``decide`` found: modules to promote (with their forecast and why), to demote, and when to sample next."""

    promote: tuple[tuple[str, Forecast, str], ...] = ()
    demote: tuple[str, ...] = ()
    next_in: int = 50
    diverging: bool = False


def decide(
    book: HeadroomBook,
    settings: HeadroomSettings,
    *,
    can_promote: bool,
    promoted: set[str],
    pinned: set[str],
    half_limit: float,
) -> Decision:
    """Promotions, demotions and the next sample's distance, from ``book`` (see the module docstring's table).

    Args:
        can_promote: a module can run in float32 here (float16 under autocast) and the budget is not spent.
        promoted: the modules the forecast has promoted (their descendants run in float32 too).
        pinned: promoted modules that relapsed after a demotion: never demoted again.
        half_limit: the training precision's largest value (a promoted module is judged against it).
    """
    s = settings
    next_in = s.every_n_steps
    urgent: list[tuple[float, str, Forecast, str]] = []
    trending: list[tuple[float, str, Forecast, str]] = []
    ready_to_demote: list[str] = []
    newest = max((entries[-1][0] for entries in book.modules.values() if entries), default=0)
    for name, entries in book.modules.items():
        module = module_of(name)  # an op entry ("attn (ops)") acts on its module
        if module != name and (_inside(module, promoted) or not entries or entries[-1][0] < newest):
            continue  # an op entry no longer sampled: a promoted module's ops, or a compiled module's after its trial
        inside = _inside(module, promoted)
        samples = book.bits(name, half_limit if inside else None)
        if not samples:
            continue
        f = forecast(samples, s.trend_samples)
        next_in = min(next_in, _next_sample(f, len(samples), s))
        if inside or name.endswith(GRADIENT):  # a gradient's headroom is reported, never acted on
            continue
        where = " (an op inside its forward)" if module != name else ""
        if f.bits < s.margin_bits:
            why = f"{f.bits:.2f} bits of headroom{where}, below the margin of {s.margin_bits:g}"
            urgent.append((f.bits, module, f, why))
        elif f.bits < s.watch_bits and f.falling and f.steps_to_zero <= s.horizon_steps:
            why = (
                f"{f.bits:.2f} bits of headroom{where}, falling {-f.slope:.3g} bits per step over the last "
                f"{s.trend_samples} samples: it reaches 0 in about {f.steps_to_zero:.0f} steps"
            )
            trending.append((f.bits, module, f, why))
    for name in promoted:
        if name in pinned or s.demote_after is None:
            continue
        family = [n for n in book.modules if n == name or n.startswith(name + ".")]
        if family and all(_recovered(book.bits(n, half_limit), s) for n in family):
            ready_to_demote.append(name)
    diverging = _diverging(book)
    chosen: list[tuple[str, Forecast, str]] = []
    if can_promote and not diverging:
        # Every module under the margin at once (outermost first: its submodules follow it into float32), else the
        # one whose trend is closest to the limit.
        for _, name, f, why in sorted(urgent, key=lambda c: (c[1].count("."), c[0])) or sorted(trending)[:1]:
            if not _inside(name, {n for n, _, _ in chosen}):
                chosen.append((name, f, why))
    return Decision(tuple(chosen), tuple(sorted(ready_to_demote)), next_in, diverging and bool(urgent or trending))


def _next_sample(f: Forecast, samples: int, s: HeadroomSettings) -> int:
    """Steps to the next sample this module asks for: ``every_n_steps``; a quarter of it until it has a trend and
    while it falls towards ``watch_bits``; under ``watch_bits``, a third of its time to the margin (at least 1)."""
    if f.bits < s.watch_bits:
        if f.slope < 0:
            return max(1, int((f.bits - s.margin_bits) / -f.slope / 3))
        return max(1, s.every_n_steps // 4)
    if samples < s.trend_samples or (f.slope < 0 and (f.bits - s.watch_bits) / -f.slope < 2 * s.every_n_steps):
        return max(1, s.every_n_steps // 4)
    return s.every_n_steps


def _inside(name: str, promoted: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in promoted)


def _recovered(samples: list[tuple[int, float]], s: HeadroomSettings) -> bool:
    assert s.demote_after is not None
    recent = samples[-s.demote_after :]
    return len(recent) >= s.demote_after and all(b >= s.watch_bits for _, b in recent)


def _diverging(book: HeadroomBook) -> bool:
    losses = [v for _, v in book.losses]
    if len(losses) < 2:
        return False
    low = min(losses[:-1])
    return low > 0 and losses[-1] > DIVERGING_LOSS_RATIO * low


def scale_cut(amax: float, scale: float, *, limit: float, margin_bits: float | None, floor: float) -> int:
    """The powers of two to lower the loss scale by (0: none) so that the loss-scaled gradient ``amax`` (the
    largest gradient times ``scale``, the scale it ran with) has ``margin_bits`` of headroom below ``limit`` again,
    without going below ``floor``. A non-finite ``amax`` is an overflow that happened (the GradScaler backs off
    itself): nothing."""
    if margin_bits is None or not math.isfinite(amax) or amax <= 0 or not math.isfinite(scale) or scale <= floor:
        return 0
    short = margin_bits - math.log2(limit / amax)
    if short <= 0:
        return 0
    room = math.floor(math.log2(scale / floor) + 1e-9) if floor > 0 else 64
    return max(0, min(math.ceil(short), room))


@dataclass
class ScaleLowerings:
    """What the loss-scale cuts of a fit did, for its summary and metrics: how many, the powers of two in all, the
    lowest headroom that called for one, and the scale before the first and after the last."""

    count: int = 0
    halvings: int = 0
    lowest_bits: float = math.inf
    first_from: float = 0.0
    last_to: float = 0.0

    def add(self, bits: float, halvings: int, before: float) -> None:
        if not self.count:
            self.first_from = before
        self.count += 1
        self.halvings += halvings
        self.lowest_bits = min(self.lowest_bits, bits)
        self.last_to = before / 2.0**halvings

    def summary(self, margin_bits: float) -> str:
        """One line: ``loss scale lowered 2x before an overflow (...)``; ``""`` when nothing was lowered."""
        if not self.count:
            return ""
        times = "once" if self.count == 1 else f"{self.count} times"
        span = f" ({self.first_from:g} -> {self.last_to:g} in this fit)" if self.first_from > 0 else ""
        lowest = f" {self.lowest_bits:.1f} bits at the lowest" if math.isfinite(self.lowest_bits) else ""
        return (
            f"loss scale lowered {times}, {2**self.halvings:g}x in all{span}, before a float16 gradient overflow "
            f"(loss-scaled gradient headroom{lowest} < margin {margin_bits:g})"
        )

    def state_dict(self) -> dict[str, object]:
        return {"count": self.count, "halvings": self.halvings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state.get("count", 0))
        self.halvings = int(state.get("halvings", 0))
