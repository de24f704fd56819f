"""The month arithmetic of the ledger's partitions (budgetgate.ledger.partitions): UTC months,
whatever the zone an instant is given in; tests/integration/test_ledger_partitions.py holds
Postgres's functions to the same bounds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.ledger.partitions import add_months, month_start, partition_name, retention_cutoff

zones = st.just(UTC) | st.builds(lambda m: timezone(timedelta(minutes=m)), st.integers(-23 * 60 - 59, 23 * 60 + 59))
# Aware instants whose UTC month, and a few years either side of it, stay within datetime's range.
instants = st.builds(
    lambda at, zone: at.replace(tzinfo=UTC).astimezone(zone), st.datetimes(min_value=datetime(100, 1, 1), max_value=datetime(9900, 12, 31)), zones
)
shifts = st.integers(-12 * 9, 12 * 9)


@given(instants)
def test_an_instant_lies_in_its_month(at: datetime) -> None:
    first = month_start(at)
    assert first.tzinfo is UTC and first.day == 1 and first.time() == datetime.min.time()
    assert first <= at < add_months(at, 1)
    assert (first.year, first.month) == (at.astimezone(UTC).year, at.astimezone(UTC).month)


@given(instants)
def test_the_next_month_starts_where_this_one_ends(at: datetime) -> None:
    # Consecutive partitions neither overlap nor leave a gap: the month after `at`'s starts at
    # the first instant that is no longer in `at`'s month.
    end = add_months(at, 1)
    assert month_start(end) == end
    assert month_start(end - timedelta(microseconds=1)) == month_start(at)
    assert 28 <= (end - month_start(at)).days <= 31


@given(instants, shifts, shifts)
def test_months_add_up(at: datetime, a: int, b: int) -> None:
    assert add_months(add_months(at, a), b) == add_months(at, a + b)
    assert add_months(add_months(at, a), -a) == month_start(at)


@given(instants, shifts)
def test_adding_months_moves_the_calendar_month(at: datetime, n: int) -> None:
    moved = add_months(at, n)
    first = month_start(at)
    assert (moved.year * 12 + moved.month) - (first.year * 12 + first.month) == n


@given(instants, st.integers(1, 240))
def test_what_is_archived_is_older_than_the_retention(now: datetime, months: int) -> None:
    # The last month archived ended `months` calendar months before now's month began, or
    # earlier; the first month kept did not.
    cutoff = retention_cutoff(now, months)
    assert month_start(cutoff) == cutoff and add_months(cutoff, months) == month_start(now)
    last_archived = cutoff - timedelta(microseconds=1)
    assert add_months(last_archived, 1) == cutoff
    assert add_months(add_months(last_archived, 1), months) <= now
    assert add_months(add_months(cutoff, 1), months) > now


@given(instants)
def test_a_partition_is_named_by_its_utc_month(at: datetime) -> None:
    utc = at.astimezone(UTC)
    assert partition_name("decisions", at) == f"decisions_p{utc.year:04d}{utc.month:02d}"
    assert partition_name("decisions", month_start(at)) == partition_name("decisions", add_months(at, 1) - timedelta(microseconds=1))


def test_zones_east_and_west_of_utc_land_in_utc_months() -> None:
    east = datetime(2026, 3, 1, 0, 30, tzinfo=timezone(timedelta(hours=2)))  # 2026-02-28T22:30Z
    west = datetime(2026, 2, 28, 20, 0, tzinfo=timezone(timedelta(hours=-5)))  # 2026-03-01T01:00Z
    assert partition_name("decisions", east) == "decisions_p202602"
    assert partition_name("decisions", west) == "decisions_p202603"
    assert add_months(datetime(2026, 12, 15, tzinfo=UTC), 1) == datetime(2027, 1, 1, tzinfo=UTC)
    assert add_months(datetime(2026, 1, 31, tzinfo=UTC), -1) == datetime(2025, 12, 1, tzinfo=UTC)


def test_naive_instants_and_no_retention_are_refused() -> None:
    with pytest.raises(ValueError, match="no time zone"):
        month_start(datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="keeps nothing"):
        retention_cutoff(datetime(2026, 1, 1, tzinfo=UTC), 0)
