"""Properties of a budget's burn-down arithmetic (budgetgate.reports.burndown): the linear
projection to the window's end and the instant the pace reaches the limit, in the ledger's
integers, against exact rational arithmetic; and of its chart (the page's inline SVG), which
stays inside its box and says the figures it draws."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from budgetgate.core.units import Unit
from budgetgate.reports.burndown import BurnDown, cumulative, exhausted_at, projected
from budgetgate.services.admission.pages import chart, number

pytestmark = pytest.mark.property

START = datetime(2026, 11, 1, tzinfo=UTC)
amounts = st.integers(min_value=0, max_value=10**15)
# Window lengths and elapsed times to the microsecond, up to about ten years.
spans = st.integers(min_value=1, max_value=10 * 366 * 86_400 * 10**6)


def us(n: int) -> timedelta:
    return timedelta(microseconds=n)


@given(consumed=amounts, length=spans, elapsed=spans)
def test_the_projection_is_the_pace_so_far_rounded_half_up(consumed: int, length: int, elapsed: int) -> None:
    assume(elapsed <= length)
    got = projected(consumed, start=START, end=START + us(length), now=START + us(elapsed))
    exact = Fraction(consumed * length, elapsed)
    assert abs(got - exact) <= Fraction(1, 2)
    assert got >= consumed
    if elapsed == length:
        assert got == consumed


@given(consumed=amounts, more=amounts, length=spans, elapsed=spans, later=spans)
def test_more_consumed_projects_more_and_a_later_reading_projects_less(consumed: int, more: int, length: int, elapsed: int, later: int) -> None:
    assume(elapsed <= length)
    end, now = START + us(length), START + us(elapsed)
    assert projected(consumed + more, start=START, end=end, now=now) >= projected(consumed, start=START, end=end, now=now)
    assert projected(consumed, start=START, end=end, now=min(end, now + us(later))) <= projected(consumed, start=START, end=end, now=now)


@given(consumed=amounts, length=spans, before=spans)
def test_before_the_start_and_after_the_end_nothing_is_extrapolated(consumed: int, length: int, before: int) -> None:
    end = START + us(length)
    assert projected(consumed, start=START, end=end, now=START - us(before)) == consumed
    assert projected(consumed, start=START, end=end, now=end + us(before)) == consumed


@given(consumed=amounts, limit=amounts, length=spans, elapsed=spans)
def test_the_limit_is_reached_when_the_pace_says_and_only_within_the_window(consumed: int, limit: int, length: int, elapsed: int) -> None:
    assume(elapsed <= length)
    end, now = START + us(length), START + us(elapsed)
    at = exhausted_at(consumed, limit, start=START, end=end, now=now)
    if consumed >= limit:
        assert at == now
        return
    if consumed == 0:
        assert at is None
        return
    exact = Fraction(limit * elapsed, consumed)  # microseconds after the start
    if at is None:
        assert exact > length - 1  # at or past the end, to the microsecond it was rounded up to
    else:
        offset = (at - START) // timedelta(microseconds=1)
        assert exact <= offset < exact + 1 and at < end and at > now


def test_negative_or_empty_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="consumed must not be negative"):
        projected(-1, start=START, end=START + us(1), now=START)
    with pytest.raises(ValueError, match="a window ends after it starts"):
        projected(1, start=START, end=START, now=START)


@given(st.lists(st.tuples(st.integers(min_value=0, max_value=1000), amounts), unique_by=lambda d: d[0], max_size=40))
def test_the_daily_curve_adds_up_in_day_order(days: list[tuple[int, int]]) -> None:
    curve = cumulative([(START + timedelta(days=d), amount) for d, amount in days])
    assert [day for day, _ in curve] == sorted(START + timedelta(days=d) for d, _ in days)
    assert [total for _, total in curve] == sorted(total for _, total in curve)
    assert (curve[-1][1] if curve else 0) == sum(amount for _, amount in days)


@given(
    limit=st.integers(min_value=0, max_value=10**12),
    consumed=st.integers(min_value=0, max_value=10**12),
    reserved=st.integers(min_value=0, max_value=10**12),
    length=st.integers(min_value=1, max_value=400 * 86_400),
    elapsed=st.integers(min_value=-86_400, max_value=500 * 86_400),
    daily=st.lists(st.tuples(st.integers(min_value=0, max_value=400), st.integers(min_value=0, max_value=10**11)), unique_by=lambda d: d[0], max_size=30),
    unit=st.sampled_from(list(Unit)),
)
def test_the_chart_stays_in_its_box_and_says_its_figures(limit: int, consumed: int, reserved: int, length: int, elapsed: int, daily, unit: Unit) -> None:  # type: ignore[no-untyped-def]
    end, now = START + timedelta(seconds=length), START + timedelta(seconds=elapsed)
    curve = cumulative([(START + timedelta(days=d), a) for d, a in daily]) if unit in (Unit.GPU_HOURS, Unit.NODE_HOURS) else None
    burn = BurnDown("p", unit, START, end, now, limit, consumed, reserved, curve)
    drawn = chart(burn, "GPU-hours")
    left, top, right, bottom = drawn.plot
    points = [tuple(float(v) for v in p.split(",")) for p in drawn.used.split()]
    points += [drawn.now, drawn.projection[:2], drawn.projection[2:], (drawn.reserved[0], drawn.reserved[1]), (left, drawn.limit_y)]
    for x, y in points:
        assert left <= x <= right and top <= y <= bottom, (x, y, drawn)
    assert drawn.reserved[2] >= 0
    assert [x for x, _ in points[: len(drawn.used.split())]] == sorted(x for x, _ in points[: len(drawn.used.split())])  # time runs left to right
    shown = burn.figures()
    assert drawn.text.startswith(f"Used {number(shown['consumed'], unit)} of {number(shown['limit'], unit)} GPU-hours")
    assert ("the limit is not reached" in drawn.text) == (burn.exhausted_at is None)
