"""The headroom forecast, without a Trainer: samples in, promotions, demotions and the next sample out."""

from __future__ import annotations

import math

import pytest

from lightning_nanguard.policies.headroom import (
    HeadroomBook,
    HeadroomSettings,
    ScaleLowerings,
    decide,
    forecast,
    scale_cut,
)
from lightning_nanguard.signals.headroom import headroom_bits

HALF = 65504.0
SETTINGS = HeadroomSettings(every_n_steps=50, margin_bits=1.0, watch_bits=6.0, horizon_steps=200, demote_after=3)


def _book(samples: dict[str, list[tuple[int, float]]], losses: list[tuple[int, float]] = ()) -> HeadroomBook:  # type: ignore[assignment]
    book = HeadroomBook(size=16)
    for name, entries in samples.items():
        for step, amax in entries:
            book.add(step, name, amax, HALF)
    for step, loss in losses:
        book.add_loss(step, loss)
    return book


def _decide(book: HeadroomBook, **kw: object) -> object:
    args: dict[str, object] = {"can_promote": True, "promoted": set(), "pinned": set(), "half_limit": HALF, **kw}
    return decide(book, SETTINGS, **args)  # type: ignore[arg-type]


def test_headroom_bits() -> None:
    assert headroom_bits(HALF / 8, HALF) == pytest.approx(3.0)
    assert headroom_bits(math.inf, HALF) == -math.inf
    assert headroom_bits(0.0, HALF) == pytest.approx(math.log2(HALF) + 24)


def test_forecast_fits_the_trend() -> None:
    f = forecast([(0, 9.0), (10, 7.0), (20, 5.0)], trend_samples=3)
    assert f.slope == pytest.approx(-0.2)
    assert f.steps_to_zero == pytest.approx(25.0)
    assert f.falling
    assert not forecast([(0, 9.0), (10, 7.0), (20, 7.5)], trend_samples=3).falling
    assert forecast([(0, 9.0)], trend_samples=3).steps_to_zero == math.inf


def test_a_module_under_the_margin_is_promoted_at_once() -> None:
    decision = _decide(_book({"head": [(0, 40000.0)], "body": [(0, 3.0)]}))
    assert [name for name, _, _ in decision.promote] == ["head"]  # type: ignore[attr-defined]


def test_a_steady_fall_towards_the_limit_is_promoted_before_it_gets_there() -> None:
    amax = [(0, 100.0), (10, 400.0), (20, 1600.0)]  # 2 bits lost per 10 steps; 5.35 bits left
    ((name, f, why),) = _decide(_book({"scores": amax})).promote  # type: ignore[attr-defined]
    assert name == "scores"
    assert f.steps_to_zero == pytest.approx(26.7, abs=0.1)
    assert "falling" in why


def test_high_noisy_or_steady_headroom_promotes_nothing() -> None:
    assert not _decide(_book({"a": [(0, 100.0), (10, 400.0), (20, 1600.0)]}), can_promote=False).promote  # type: ignore[attr-defined]
    assert not _decide(_book({"a": [(0, 1.0), (10, 4.0), (20, 16.0)]})).promote  # type: ignore[attr-defined]  # far
    assert not _decide(_book({"a": [(0, 3000.0), (10, 1600.0), (20, 3000.0)]})).promote  # type: ignore[attr-defined]


def test_a_diverging_run_is_not_promoted() -> None:
    book = _book({"a": [(0, 100.0), (10, 400.0), (20, 1600.0)]}, losses=[(0, 1.0), (10, 1.5), (20, 3.0)])
    decision = _decide(book)
    assert not decision.promote  # type: ignore[attr-defined]
    assert decision.diverging  # type: ignore[attr-defined]


def test_samples_come_sooner_near_the_limit() -> None:
    assert _decide(_book({"a": [(0, 1.0), (50, 1.0), (100, 1.0)]})).next_in == 50  # type: ignore[attr-defined]
    assert _decide(_book({"a": [(0, 1.0)]})).next_in == 12  # type: ignore[attr-defined]  # no trend yet
    near = _decide(_book({"a": [(0, 2000.0), (10, 4000.0), (20, 8000.0)]}), can_promote=False)
    assert near.next_in == 6  # type: ignore[attr-defined]


def test_a_recovered_promotion_is_demoted_unless_pinned() -> None:
    book = _book(
        {
            "head": [(0, 40000.0), (10, 100.0), (20, 100.0), (30, 100.0)],
            "head.inner": [(10, 10.0), (20, 10.0), (30, 10.0)],
        }
    )
    assert _decide(book, promoted={"head"}).demote == ("head",)  # type: ignore[attr-defined]
    assert _decide(book, promoted={"head"}, pinned={"head"}).demote == ()  # type: ignore[attr-defined]
    book.add(40, "head.inner", 20000.0, HALF)  # a submodule is close to the limit: not yet
    assert _decide(book, promoted={"head"}).demote == ()  # type: ignore[attr-defined]


def test_the_book_round_trips_and_rebases() -> None:
    book = HeadroomBook(size=4)
    book.add(0, "a", 1e5, 3.4e38)  # a float32 run
    book.add(1, "a", math.nan, 3.4e38)  # non-finite: not kept
    copy = HeadroomBook(size=4)
    copy.load_state_dict(book.state_dict())
    assert copy.modules == book.modules
    copy.rebase(HALF)
    assert copy.latest()["a"] < 0  # past float16's range


def _cut(amax: float, scale: float = 65536.0, margin: float | None = 4.0, floor: float = 1.0) -> int:
    return scale_cut(amax, scale, limit=HALF, margin_bits=margin, floor=floor)


def test_the_loss_scale_is_cut_by_the_powers_of_two_that_bring_back_the_margin() -> None:
    assert _cut(HALF / 2**1.3) == 3  # 1.3 bits: 2.7 short of 4, three halvings (4.3 bits)
    assert _cut(HALF / 2**2.0) == 2  # exactly 2 short: two
    assert _cut(HALF / 2**4.0) == 0  # at the margin: nothing
    assert _cut(HALF / 2**9.0) == 0
    assert _cut(HALF / 2**1.3, margin=None) == 0  # off


def test_the_cut_stops_at_the_floor_and_leaves_an_overflow_to_the_gradscaler() -> None:
    assert _cut(HALF / 2**0.5, scale=4.0, floor=1.0) == 2  # 4 -> 1, not below
    assert _cut(HALF / 2**0.5, scale=3.0, floor=1.0) == 1  # 3 -> 1.5 (a third halving would pass 1)
    assert _cut(HALF, scale=1.0, floor=1.0) == 0  # at the floor already
    assert _cut(math.inf) == 0  # overflowed: the GradScaler drops the step and halves itself
    assert _cut(math.nan) == 0
    assert _cut(0.0) == 0


def test_the_lowerings_are_summed_up_in_one_line() -> None:
    lowerings = ScaleLowerings()
    assert lowerings.summary(4.0) == ""
    lowerings.add(1.3, 3, 65536.0)
    lowerings.add(3.2, 1, 16384.0)
    assert lowerings.summary(4.0) == (
        "loss scale lowered 2 times, 16x in all (65536 -> 8192 in this fit), before a float16 gradient overflow "
        "(loss-scaled gradient headroom 1.3 bits at the lowest < margin 4)"
    )
    restored = ScaleLowerings()
    restored.load_state_dict(lowerings.state_dict())
    assert (restored.count, restored.halvings) == (2, 4)
    assert restored.summary(4.0).startswith("loss scale lowered 2 times, 16x in all, before")
