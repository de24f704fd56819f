"""Properties of the chargeback report's arithmetic: the rate segments it prices by, the periods
it rolls days up into, and the instants it reads."""

from __future__ import annotations

import bisect
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.core.policy import PolicyBundle, Rate, RateCard, Source
from budgetgate.core.units import cost_micros
from budgetgate.core.windows import rfc3339
from budgetgate.reports.chargeback import breakpoints, instant, period_start

pytestmark = pytest.mark.property

START = datetime(2026, 1, 1, tzinfo=UTC)
instants = st.integers(min_value=0, max_value=400 * 86_400_000_000).map(lambda us: START + timedelta(microseconds=us))
days = st.integers(min_value=-3650, max_value=3650).map(lambda n: START + timedelta(days=n))
rates = st.builds(
    Rate,
    flavor=st.sampled_from(["h100", "a100"]),
    rate_per_gpu_hour=st.decimals(min_value=0, max_value=100, places=3, allow_nan=False, allow_infinity=False),
    region=st.sampled_from([None, "eu"]),
    effective_from=st.none() | instants,
)


@given(st.lists(rates, min_size=1, max_size=8), instants, instants, st.sampled_from(["h100", "a100"]), st.sampled_from([None, "eu", "us"]))
def test_one_rate_holds_between_two_breakpoints(found: list[Rate], a: datetime, b: datetime, flavor: str, region: str | None) -> None:
    # The report prices each row of one rate segment at one instant of it: any other instant of
    # the segment must have the same rate.
    bundle = PolicyBundle(git_sha="p", rate_cards=(RateCard(id="r", currency="USD", rates=tuple(found), source=Source("r.yaml", 0)),))
    a, b = min(a, b), max(a, b)
    breaks = breakpoints(bundle, START - timedelta(days=1), START + timedelta(days=500))
    if bisect.bisect_right(breaks, a) == bisect.bisect_right(breaks, b):
        first, second = bundle.rate_for(flavor, region, a), bundle.rate_for(flavor, region, b)
        assert (first and first[0].rate_per_gpu_hour) == (second and second[0].rate_per_gpu_hour)


@given(days, st.sampled_from(["day", "week", "month"]))
def test_a_day_falls_in_the_period_that_starts_at_or_before_it(day: datetime, period: str) -> None:
    start = period_start(day, period)
    assert start is not None and start <= day
    assert start.hour == start.minute == start.second == 0
    if period == "day":
        assert start == day
    elif period == "week":
        assert start.weekday() == 0 and day - start < timedelta(days=7)
    else:
        assert start.day == 1 and (start.year, start.month) == (day.year, day.month)


@given(instants)
def test_an_rfc3339_instant_reads_back_as_itself(at: datetime) -> None:
    assert instant(rfc3339(at), "from") == at
    assert instant(at.date().isoformat(), "from") == datetime.combine(at.date(), datetime.min.time(), tzinfo=UTC)


@given(st.lists(st.integers(min_value=0, max_value=10**12), max_size=20), st.decimals(min_value=0, max_value=1000, places=6))
def test_pricing_a_sum_once_is_within_half_a_micro_per_part_of_pricing_the_parts(parts: list[int], rate: Decimal) -> None:
    # A row is priced once over its sum; priced part by part (as the reconciler charges hour
    # pieces) each part rounds by at most half a micro-unit.
    assert abs(cost_micros(sum(parts), rate) - sum(cost_micros(p, rate) for p in parts)) <= (len(parts) + 1) / 2
