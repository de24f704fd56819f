"""Budget windows: calendar bounds in UTC and in time zones, month ends, leap days, DST, rolling."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from budgetgate.core.windows import Window, WindowSpec, iso, window_at, zone

MONTH = WindowSpec(calendar="month")
WEEK = WindowSpec(calendar="week")
DAY = WindowSpec(calendar="day")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def in_zone(name: str, *args: int) -> datetime:
    return datetime(*args, tzinfo=ZoneInfo(name))  # type: ignore[misc]


def bounds(window: Window) -> tuple[datetime, datetime]:
    return window.start, window.end


# --- calendar windows in UTC -------------------------------------------------------------------


def test_month_in_utc() -> None:
    window = window_at(MONTH, utc(2026, 1, 15, 12, 30))
    assert bounds(window) == (utc(2026, 1, 1), utc(2026, 2, 1))
    assert window.key == "2026-01-01T00:00:00Z/2026-02-01T00:00:00Z"


def test_window_bounds_are_utc_instants() -> None:
    window = window_at(MONTH, in_zone("Asia/Kolkata", 2026, 1, 15))
    assert window.start.utcoffset() == timedelta(0)
    assert window.end.utcoffset() == timedelta(0)


def test_last_instant_of_january_is_in_january_and_the_next_is_in_february() -> None:
    january = window_at(MONTH, utc(2026, 1, 31, 23, 59, 59, 999999))
    february = window_at(MONTH, utc(2026, 2, 1))
    assert bounds(january) == (utc(2026, 1, 1), utc(2026, 2, 1))
    assert bounds(february) == (utc(2026, 2, 1), utc(2026, 3, 1))
    assert january.key != february.key


def test_january_31_rolls_over_to_february_not_march() -> None:
    # A naive "same day next month" would fail on the 31st; the window starts on day 1.
    window = window_at(MONTH, utc(2026, 1, 31, 8))
    assert window.end == utc(2026, 2, 1)
    assert window_at(MONTH, window.end).end == utc(2026, 3, 1)


def test_december_ends_in_january_of_next_year() -> None:
    window = window_at(MONTH, utc(2026, 12, 31, 23))
    assert bounds(window) == (utc(2026, 12, 1), utc(2027, 1, 1))
    assert window.key == "2026-12-01T00:00:00Z/2027-01-01T00:00:00Z"


def test_leap_day_is_in_the_february_window() -> None:
    window = window_at(MONTH, utc(2028, 2, 29, 12))
    assert bounds(window) == (utc(2028, 2, 1), utc(2028, 3, 1))
    assert window.end - window.start == timedelta(days=29)
    assert window.contains(utc(2028, 2, 29, 23, 59, 59))
    assert not window.contains(utc(2028, 3, 1))


def test_february_in_a_common_year_has_28_days() -> None:
    window = window_at(MONTH, utc(2027, 2, 14))
    assert window.end - window.start == timedelta(days=28)


def test_leap_day_window() -> None:
    window = window_at(DAY, utc(2028, 2, 29, 23, 59))
    assert bounds(window) == (utc(2028, 2, 29), utc(2028, 3, 1))


@pytest.mark.parametrize(
    ("at", "monday"),
    [
        (utc(2026, 3, 4, 10), utc(2026, 3, 2)),  # Wednesday
        (utc(2026, 3, 2), utc(2026, 3, 2)),  # Monday midnight starts its own week
        (utc(2026, 3, 8, 23, 59), utc(2026, 3, 2)),  # Sunday night is still the same ISO week
        (utc(2026, 1, 1), utc(2025, 12, 29)),  # a week across the new year
        (utc(2028, 2, 29), utc(2028, 2, 28)),
    ],
)
def test_weeks_are_iso_weeks_starting_monday(at: datetime, monday: datetime) -> None:
    window = window_at(WEEK, at)
    assert bounds(window) == (monday, monday + timedelta(days=7))
    assert window.start.weekday() == 0


def test_day_in_utc() -> None:
    window = window_at(DAY, utc(2026, 6, 30, 23, 59, 59))
    assert bounds(window) == (utc(2026, 6, 30), utc(2026, 7, 1))


def test_instant_given_in_another_zone_is_placed_by_its_utc_time() -> None:
    # 2026-02-01 01:00 in Berlin is still 31 January in UTC.
    window = window_at(MONTH, in_zone("Europe/Berlin", 2026, 2, 1, 0, 30))
    assert bounds(window) == (utc(2026, 1, 1), utc(2026, 2, 1))


# --- calendar windows in time zones ------------------------------------------------------------


def test_month_in_new_york_starts_at_local_midnight() -> None:
    spec = WindowSpec(calendar="month", timezone="America/New_York")
    window = window_at(spec, utc(2026, 1, 15))
    assert bounds(window) == (utc(2026, 1, 1, 5), utc(2026, 2, 1, 5))
    assert window.key == "2026-01-01T05:00:00Z/2026-02-01T05:00:00Z"


def test_local_month_decides_which_window_an_instant_is_in() -> None:
    spec = WindowSpec(calendar="month", timezone="America/New_York")
    # 2026-02-01 03:00 UTC is still 31 January, 22:00, in New York.
    window = window_at(spec, utc(2026, 2, 1, 3))
    assert bounds(window) == (utc(2026, 1, 1, 5), utc(2026, 2, 1, 5))


def test_month_containing_spring_forward_is_an_hour_short() -> None:
    spec = WindowSpec(calendar="month", timezone="America/New_York")
    window = window_at(spec, utc(2026, 3, 20))
    assert bounds(window) == (utc(2026, 3, 1, 5), utc(2026, 4, 1, 4))
    assert window.end - window.start == timedelta(days=31, hours=-1)


def test_month_in_kolkata_half_hour_offset() -> None:
    spec = WindowSpec(calendar="month", timezone="Asia/Kolkata")
    window = window_at(spec, utc(2026, 1, 10))
    assert bounds(window) == (utc(2025, 12, 31, 18, 30), utc(2026, 1, 31, 18, 30))
    # 19:00 UTC on 31 January is already 1 February, 00:30, in Kolkata.
    february = window_at(spec, utc(2026, 1, 31, 19))
    assert bounds(february) == (utc(2026, 1, 31, 18, 30), utc(2026, 2, 28, 18, 30))


def test_december_ends_in_january_in_a_zone_ahead_of_utc() -> None:
    spec = WindowSpec(calendar="month", timezone="Asia/Kolkata")
    window = window_at(spec, in_zone("Asia/Kolkata", 2026, 12, 31, 23, 59))
    assert bounds(window) == (utc(2026, 11, 30, 18, 30), utc(2026, 12, 31, 18, 30))


def test_leap_february_in_berlin() -> None:
    spec = WindowSpec(calendar="month", timezone="Europe/Berlin")
    window = window_at(spec, in_zone("Europe/Berlin", 2028, 2, 29, 23, 30))
    assert bounds(window) == (utc(2028, 1, 31, 23), utc(2028, 2, 29, 23))
    assert window.end - window.start == timedelta(days=29)


@pytest.mark.parametrize(
    ("timezone", "at", "start", "end", "length"),
    [
        # New York springs forward on 2026-03-08 and falls back on 2026-11-01.
        ("America/New_York", utc(2026, 3, 8, 12), utc(2026, 3, 8, 5), utc(2026, 3, 9, 4), timedelta(hours=23)),
        ("America/New_York", utc(2026, 11, 1, 12), utc(2026, 11, 1, 4), utc(2026, 11, 2, 5), timedelta(hours=25)),
        # Berlin changes on the last Sundays of March and October.
        ("Europe/Berlin", utc(2026, 3, 29, 12), utc(2026, 3, 28, 23), utc(2026, 3, 29, 22), timedelta(hours=23)),
        ("Europe/Berlin", utc(2026, 10, 25, 12), utc(2026, 10, 24, 22), utc(2026, 10, 25, 23), timedelta(hours=25)),
        # Lord Howe Island shifts by half an hour (+10:30 ⇄ +11:00).
        ("Australia/Lord_Howe", utc(2026, 10, 4, 0), utc(2026, 10, 3, 13, 30), utc(2026, 10, 4, 13), timedelta(hours=23, minutes=30)),
        ("Australia/Lord_Howe", utc(2026, 4, 5, 0), utc(2026, 4, 4, 13), utc(2026, 4, 5, 13, 30), timedelta(hours=24, minutes=30)),
        # Kolkata has no DST: every day is 24 hours.
        ("Asia/Kolkata", utc(2026, 3, 29, 12), utc(2026, 3, 28, 18, 30), utc(2026, 3, 29, 18, 30), timedelta(hours=24)),
    ],
)
def test_day_window_on_dst_change_days(timezone: str, at: datetime, start: datetime, end: datetime, length: timedelta) -> None:
    window = window_at(WindowSpec(calendar="day", timezone=timezone), at)
    assert bounds(window) == (start, end)
    assert window.end - window.start == length
    # Both bounds are local midnight.
    assert window.start.astimezone(zone(timezone)).time() == datetime.min.time()
    assert window.end.astimezone(zone(timezone)).time() == datetime.min.time()


def test_instants_in_the_repeated_hour_share_one_day_window() -> None:
    spec = WindowSpec(calendar="day", timezone="America/New_York")
    first = in_zone("America/New_York", 2026, 11, 1, 1, 30)  # EDT
    second = first.replace(fold=1)  # the same wall time an hour later, EST
    assert second.astimezone(UTC) - first.astimezone(UTC) == timedelta(hours=1)
    assert window_at(spec, first) == window_at(spec, second)


def test_ambiguous_local_midnight_starts_the_day_at_its_first_occurrence() -> None:
    # Cuba falls back at 01:00 CDT to 00:00 CST, so on 2026-11-01 midnight happens twice.
    spec = WindowSpec(calendar="day", timezone="America/Havana")
    first_pass = in_zone("America/Havana", 2026, 11, 1, 0, 30)
    second_pass = first_pass.replace(fold=1)
    window = window_at(spec, second_pass)
    assert bounds(window) == (utc(2026, 11, 1, 4), utc(2026, 11, 2, 5))
    assert window.end - window.start == timedelta(hours=25)
    assert window_at(spec, first_pass) == window
    assert window_at(spec, window.start - timedelta(microseconds=1)).end == window.start


def test_week_containing_spring_forward() -> None:
    spec = WindowSpec(calendar="week", timezone="America/New_York")
    window = window_at(spec, in_zone("America/New_York", 2026, 3, 8, 12))
    assert bounds(window) == (utc(2026, 3, 2, 5), utc(2026, 3, 9, 4))
    assert window.end - window.start == timedelta(days=7, hours=-1)


def test_week_containing_fall_back_in_berlin() -> None:
    spec = WindowSpec(calendar="week", timezone="Europe/Berlin")
    window = window_at(spec, in_zone("Europe/Berlin", 2026, 10, 22))
    assert bounds(window) == (utc(2026, 10, 18, 22), utc(2026, 10, 25, 23))
    assert window.end - window.start == timedelta(days=7, hours=1)
    # The next week starts exactly where this one ends, at Monday midnight in Berlin (CET).
    assert window_at(spec, window.end).start == window.end


def test_dst_gap_at_local_midnight_starts_the_day_when_the_clock_jumps() -> None:
    # Chile springs forward at 24:00: 2026-09-06 00:00 local does not exist, the clock reads 01:00.
    spec = WindowSpec(calendar="day", timezone="America/Santiago")
    window = window_at(spec, in_zone("America/Santiago", 2026, 9, 6, 12))
    assert window.start == utc(2026, 9, 6, 4)  # the instant the day really begins (00:00 -04 → 01:00 -03)
    assert window.end == utc(2026, 9, 7, 3)
    assert window.end - window.start == timedelta(hours=23)
    assert window_at(spec, window.start - timedelta(microseconds=1)).end == window.start


# --- rolling windows ---------------------------------------------------------------------------


def test_rolling_window_ends_now_and_starts_n_days_ago() -> None:
    spec = WindowSpec(rolling_days=30)
    at = utc(2026, 3, 15, 12, 34, 56)
    window = window_at(spec, at)
    assert bounds(window) == (utc(2026, 2, 13, 12, 34, 56), at)
    assert window.key == "rolling-30d"


def test_rolling_window_key_is_stable_as_time_moves() -> None:
    spec = WindowSpec(rolling_days=7)
    keys = {window_at(spec, utc(2026, 1, 1) + timedelta(hours=h)).key for h in range(0, 24 * 60, 13)}
    assert keys == {"rolling-7d"}


def test_rolling_window_given_a_zoned_instant_is_in_utc() -> None:
    spec = WindowSpec(rolling_days=1)
    window = window_at(spec, in_zone("Asia/Kolkata", 2026, 1, 1, 5, 30))
    assert bounds(window) == (utc(2025, 12, 31), utc(2026, 1, 1))
    assert window.end.utcoffset() == timedelta(0)


def test_rolling_window_spans_dst_as_exact_days() -> None:
    # A rolling window counts elapsed time, not wall-clock days.
    spec = WindowSpec(rolling_days=1, timezone="America/New_York")
    window = window_at(spec, in_zone("America/New_York", 2026, 3, 8, 12))
    assert window.end - window.start == timedelta(days=1)


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [MONTH, WEEK, DAY, WindowSpec(rolling_days=30)])
def test_naive_instants_are_rejected(spec: WindowSpec) -> None:
    with pytest.raises(ValueError, match="time-zone aware"):
        window_at(spec, datetime(2026, 1, 1, 12))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of calendar or rolling_days"),
        ({"calendar": "month", "rolling_days": 30}, "exactly one of calendar or rolling_days"),
        ({"calendar": "year"}, "calendar must be one of month, week, day"),
        ({"rolling_days": 0}, "between 1 and 3660"),
        ({"rolling_days": 3661}, "between 1 and 3660"),
        ({"calendar": "month", "timezone": "Mars/Olympus_Mons"}, "unknown time zone 'Mars/Olympus_Mons'"),
        ({"calendar": "month", "timezone": "../../etc/passwd"}, "unknown time zone"),
        ({"calendar": "month", "timezone": ""}, "unknown time zone"),
    ],
)
def test_invalid_specs_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WindowSpec(**kwargs)  # type: ignore[arg-type]


def test_rolling_day_limits_are_inclusive() -> None:
    assert WindowSpec(rolling_days=1).rolling
    assert WindowSpec(rolling_days=3660).rolling
    assert not MONTH.rolling


def test_contains_is_half_open() -> None:
    window = window_at(DAY, utc(2026, 5, 5, 5))
    assert window.contains(window.start)
    assert not window.contains(window.end)
    assert window.contains(window.end - timedelta(microseconds=1))
    assert not window.contains(window.start - timedelta(microseconds=1))


def test_iso_is_utc_with_z_and_seconds() -> None:
    assert iso(in_zone("Europe/Berlin", 2026, 7, 1, 2, 3, 4, 999999)) == "2026-07-01T00:03:04Z"
    assert iso(utc(2026, 1, 1)) == "2026-01-01T00:00:00Z"


@pytest.mark.parametrize("name", ["Europe", "America", "Etc", "x" * 300, "Europe/" + "y" * 300])
def test_a_zone_folder_or_an_overlong_name_is_an_unknown_time_zone(name: str) -> None:
    # The zone database is a folder of files: these are OSErrors there, a ValueError here.
    with pytest.raises(ValueError, match="unknown time zone"):
        zone(name)
    with pytest.raises(ValueError, match="unknown time zone"):
        WindowSpec(calendar="month", timezone=name)


# --- fiscal years ----------------------------------------------------------------------------------

APRIL = WindowSpec(calendar="fiscal_year", start_month=4)


def test_a_fiscal_year_from_april() -> None:
    assert bounds(window_at(APRIL, utc(2026, 3, 31, 23, 59))) == (utc(2025, 4, 1), utc(2026, 4, 1))
    window = window_at(APRIL, utc(2026, 4, 1))
    assert bounds(window) == (utc(2026, 4, 1), utc(2027, 4, 1))
    assert window.key == "2026-04-01T00:00:00Z/2027-04-01T00:00:00Z"


def test_a_fiscal_year_from_january_is_the_calendar_year() -> None:
    assert bounds(window_at(WindowSpec(calendar="fiscal_year", start_month=1), utc(2028, 2, 29))) == (utc(2028, 1, 1), utc(2029, 1, 1))


def test_a_fiscal_year_starts_at_local_midnight_in_its_zone() -> None:
    # 1 October in Sydney is in daylight time (UTC+10 until the first Sunday of October).
    spec = WindowSpec(calendar="fiscal_year", timezone="Australia/Sydney", start_month=10)
    window = window_at(spec, in_zone("Australia/Sydney", 2026, 10, 1, 0, 30))
    assert bounds(window) == (utc(2026, 9, 30, 14), utc(2027, 9, 30, 14))
    # A minute before that local midnight is still the previous fiscal year.
    assert window_at(spec, utc(2026, 9, 30, 13, 59)).end == window.start


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"calendar": "fiscal_year"}, "only a fiscal year, has a start_month"),
        ({"calendar": "month", "start_month": 4}, "only a fiscal year, has a start_month"),
        ({"calendar": "fiscal_year", "start_month": 13}, "start_month must be a month"),
    ],
)
def test_a_fiscal_year_needs_a_month_and_only_it_has_one(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WindowSpec(**fields)
