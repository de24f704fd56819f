"""Properties of the fixed-point units and of calendar arithmetic (budget windows)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from zoneinfo import available_timezones

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from budgetgate.core.units import MILLI_PER_HOUR, Unit, cost_micros, from_amount, hours_amount, limit_amount, money, to_amount, to_decimal
from budgetgate.core.windows import CALENDARS, FISCAL_YEAR, WindowSpec, window_at, zone

pytestmark = pytest.mark.property

HOUR_UNITS = [Unit.GPU_HOURS, Unit.NODE_HOURS, Unit.WALL_HOURS]

counts = st.integers(min_value=0, max_value=100_000)
# Runtimes as they arrive: up to a year, to the microsecond-hour and beyond.
runtimes = st.decimals(min_value=0, max_value=24 * 366, places=9, allow_nan=False, allow_infinity=False)
rates = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False, allow_infinity=False)


def decimals_with(places: int) -> st.SearchStrategy[Decimal]:
    return st.decimals(min_value=-(10**9), max_value=10**9, places=places, allow_nan=False, allow_infinity=False)


# --- units -------------------------------------------------------------------------------------


@given(a=counts, b=counts, h=runtimes)
def test_hours_amount_is_monotone_in_count(a: int, b: int, h: Decimal) -> None:
    low, high = sorted((a, b))
    assert hours_amount(low, h) <= hours_amount(high, h)


@given(c=counts, h1=runtimes, h2=runtimes)
def test_hours_amount_is_monotone_in_runtime(c: int, h1: Decimal, h2: Decimal) -> None:
    low, high = sorted((h1, h2))
    assert hours_amount(c, low) <= hours_amount(c, high)


@given(a=counts, b=counts, h=runtimes)
def test_hours_amount_is_additive_in_gpus_within_one_unit(a: int, b: int, h: Decimal) -> None:
    assert abs(hours_amount(a + b, h) - (hours_amount(a, h) + hours_amount(b, h))) <= 1


@given(c=counts, h=runtimes)
def test_hours_amount_is_never_negative_and_within_half_a_unit_of_exact(c: int, h: Decimal) -> None:
    amount = hours_amount(c, h)
    assert amount >= 0
    assert abs(Decimal(amount) - Decimal(c) * h * MILLI_PER_HOUR) <= Decimal("0.5")


@given(c=counts, h=st.decimals(min_value=0, max_value=10_000, places=5))
def test_hours_with_five_fractional_digits_are_exact(c: int, h: Decimal) -> None:
    # One unit is a milli-GPU-second: 1/3,600,000 of an hour, so 0.00001 h (36 units) is exact.
    assert hours_amount(c, h) == Decimal(c) * h * MILLI_PER_HOUR


@given(c=counts, h=st.floats(min_value=0, max_value=10_000, allow_nan=False, allow_infinity=False))
def test_float_runtime_is_read_as_its_shortest_repr(c: int, h: float) -> None:
    assert hours_amount(c, h) == hours_amount(c, repr(h))


@given(unit=st.sampled_from(HOUR_UNITS), value=decimals_with(5))
def test_hour_figures_round_trip_exactly(unit: Unit, value: Decimal) -> None:
    amount = to_amount(unit, value)
    assert from_amount(unit, amount) == value
    assert to_amount(unit, str(value)) == amount


@given(value=decimals_with(6))
def test_money_figures_round_trip_exactly(value: Decimal) -> None:
    amount = to_amount(Unit.COST, value)
    assert from_amount(Unit.COST, amount) == value


@given(unit=st.sampled_from(list(Unit)), amount=st.integers(min_value=-(10**18), max_value=10**18))
def test_every_ledger_amount_survives_the_trip_through_a_figure(unit: Unit, amount: int) -> None:
    assert to_amount(unit, from_amount(unit, amount)) == amount


@given(unit=st.sampled_from(list(Unit)), x=st.floats(allow_nan=True, allow_infinity=True))
def test_only_finite_floats_are_amounts(unit: Unit, x: float) -> None:
    if x != x or x in (float("inf"), float("-inf")):
        with pytest.raises(ValueError):
            to_amount(unit, x)
    else:
        assume(abs(x) < 1e15)
        assert to_amount(unit, x) == to_amount(unit, to_decimal(repr(x)))


@given(m1=st.integers(min_value=0, max_value=10**15), m2=st.integers(min_value=0, max_value=10**15), r1=rates, r2=rates)
def test_cost_is_monotone_in_amount_and_rate(m1: int, m2: int, r1: Decimal, r2: Decimal) -> None:
    low_m, high_m = sorted((m1, m2))
    low_r, high_r = sorted((r1, r2))
    assert 0 <= cost_micros(low_m, low_r) <= cost_micros(high_m, low_r) <= cost_micros(high_m, high_r)


@given(c=counts, h=st.decimals(min_value=0, max_value=10_000, places=5), r=rates)
def test_cost_of_exact_hours_is_within_half_a_micro(c: int, h: Decimal, r: Decimal) -> None:
    micros = cost_micros(hours_amount(c, h), r)
    assert abs(Decimal(micros) - Decimal(c) * h * r * 1_000_000) <= Decimal("0.5")


@given(micros=st.integers(min_value=0, max_value=10**18), other=st.integers(min_value=0, max_value=10**18))
def test_money_is_monotone_and_within_half_a_cent(micros: int, other: int) -> None:
    shown = money(micros)
    assert shown.as_tuple().exponent == -2
    assert abs(shown - Decimal(micros) / 1_000_000) <= Decimal("0.005")
    if micros <= other:
        assert shown <= money(other)


limits = st.decimals(min_value=Decimal("1e-12"), max_value=10**9, places=12, allow_nan=False, allow_infinity=False)


@given(unit=st.sampled_from(list(Unit)), value=limits)
def test_a_limit_is_rounded_down_to_the_ledgers_unit_never_up(unit: Unit, value: Decimal) -> None:
    amount = limit_amount(unit, value)
    # Never more generous than written, and short of it by less than one unit.
    assert from_amount(unit, amount) <= value < from_amount(unit, amount + 1)
    assert amount <= to_amount(unit, value)


@given(unit=st.sampled_from(list(Unit)), value=limits)
def test_a_limit_documents_refuse_is_exactly_one_that_rounds_to_nothing(unit: Unit, value: Decimal) -> None:
    from pydantic import ValidationError

    from budgetgate.core.documents import LimitDoc

    fields = {str(unit): value} | ({"currency": "USD"} if unit is Unit.COST else {})
    try:
        LimitDoc.model_validate(fields)
    except ValidationError as exc:
        assert limit_amount(unit, value) == 0 and "limit of 0" in str(exc)
    else:
        assert limit_amount(unit, value) > 0


# --- windows -----------------------------------------------------------------------------------


def _loadable(name: str) -> bool:
    try:
        zone(name)
    except ValueError:
        return False
    return True


# Every zone name the project can load.
ZONES = sorted(name for name in available_timezones() if _loadable(name))

fiscal_specs = st.builds(WindowSpec, calendar=st.just(FISCAL_YEAR), timezone=st.sampled_from(ZONES), start_month=st.integers(min_value=1, max_value=12))
calendar_specs = st.one_of(st.builds(WindowSpec, calendar=st.sampled_from(CALENDARS), timezone=st.sampled_from(ZONES)), fiscal_specs)
rolling_specs = st.builds(WindowSpec, rolling_days=st.integers(min_value=1, max_value=3660))
specs = st.one_of(calendar_specs, rolling_specs)


# Instants from 2012 on. Earlier tz history has a handful of transitions that cross local
# midnight (Canada/Eastern 1919 skipped 23:30-00:30; Newfoundland fell back from 00:01 to 23:01
# until 2010), where a local day is not one contiguous span; admission instants are present-day.
instants = st.datetimes(
    min_value=datetime(2012, 1, 1),
    max_value=datetime(2200, 1, 1),
    timezones=st.sampled_from([UTC, *map(zone, ZONES)]),
    allow_imaginary=False,
)


@settings(deadline=None)
@given(spec=specs, at=instants)
def test_window_is_a_utc_span_reaching_its_instant(spec: WindowSpec, at: datetime) -> None:
    window = window_at(spec, at)
    assert window.start < window.end
    assert window.start <= at.astimezone(UTC) <= window.end
    assert window.start.utcoffset() == window.end.utcoffset() == timedelta(0)


@settings(deadline=None)
@given(spec=calendar_specs, at=instants)
def test_calendar_window_contains_its_instant(spec: WindowSpec, at: datetime) -> None:
    assert window_at(spec, at).contains(at)


@settings(deadline=None)
@given(spec=calendar_specs, at=instants)
def test_calendar_windows_tile_time(spec: WindowSpec, at: datetime) -> None:
    window = window_at(spec, at)
    following = window_at(spec, window.end)
    preceding = window_at(spec, window.start - timedelta(microseconds=1))
    assert following.start == window.end
    assert preceding.end == window.start
    assert len({preceding.key, window.key, following.key}) == 3


@settings(deadline=None)
@given(spec=calendar_specs, at=instants)
def test_every_instant_of_a_window_gets_the_same_window(spec: WindowSpec, at: datetime) -> None:
    window = window_at(spec, at)
    assert window_at(spec, window.start) == window
    assert window_at(spec, window.end - timedelta(microseconds=1)) == window


@settings(deadline=None)
@given(spec=calendar_specs, at=instants)
def test_calendar_windows_follow_the_local_calendar(spec: WindowSpec, at: datetime) -> None:
    tz = zone(spec.timezone)
    window = window_at(spec, at)
    local_at = at.astimezone(tz).date()
    local_start = window.start.astimezone(tz).date()
    if spec.calendar == "day":
        assert local_start == local_at
    elif spec.calendar == "week":
        assert local_start.weekday() == 0
        assert 0 <= (local_at - local_start).days < 7
    elif spec.calendar == FISCAL_YEAR:
        year = local_at.year if local_at.month >= (spec.start_month or 1) else local_at.year - 1
        assert (local_start.year, local_start.month, local_start.day) == (year, spec.start_month, 1)
    else:
        assert (local_start.year, local_start.month, local_start.day) == (local_at.year, local_at.month, 1)


@settings(deadline=None)
@given(spec=rolling_specs, at=instants)
def test_rolling_windows_end_at_the_instant(spec: WindowSpec, at: datetime) -> None:
    window = window_at(spec, at)
    # In UTC: Python never calls an instant in a repeated (DST fold) hour equal across zones.
    assert window.end == at.astimezone(UTC)
    assert window.end - window.start == timedelta(days=spec.rolling_days or 0)
    assert window.key == f"rolling-{spec.rolling_days}d"


@settings(deadline=None)
@given(spec=fiscal_specs, at=instants)
def test_a_fiscal_year_runs_from_local_midnight_of_its_month_to_the_same_a_year_later(spec: WindowSpec, at: datetime) -> None:
    tz = zone(spec.timezone)
    window = window_at(spec, at)
    start, end = window.start.astimezone(tz), window.end.astimezone(tz)
    assert (end.year - start.year, end.month, end.day) == (1, start.month, 1) == (1, spec.start_month, 1)
    # Local midnight, unless it did not exist that day (a DST gap at midnight): then the first
    # instant after it, within the hour or two such a gap lasts.
    for edge in (start, end):
        assert (edge.hour, edge.minute) == (0, 0) or (edge.hour < 3 and (edge - timedelta(hours=edge.hour, minutes=edge.minute)).day == 1)
    # 365 or 366 days, give or take the zone's offset changing between the two dates.
    assert timedelta(days=365) - timedelta(hours=3) <= window.end - window.start <= timedelta(days=366) + timedelta(hours=3)


@given(start_month=st.integers(min_value=1, max_value=12), year=st.integers(min_value=2012, max_value=2199), month=st.integers(min_value=1, max_value=12))
def test_a_fiscal_year_is_named_by_the_year_it_starts_in(start_month: int, year: int, month: int) -> None:
    window = window_at(WindowSpec(calendar=FISCAL_YEAR, start_month=start_month), datetime(year, month, 15, tzinfo=UTC))
    began = year if month >= start_month else year - 1
    assert window.key == f"{began}-{start_month:02d}-01T00:00:00Z/{began + 1}-{start_month:02d}-01T00:00:00Z"
