"""Budget windows: calendar months, weeks and days, or fiscal years starting in a chosen month, in a
time zone; or rolling N days."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

CALENDARS = ("month", "week", "day")
FISCAL_YEAR = "fiscal_year"  # a year from the first of `start_month`, local midnight


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """How a policy's window is laid out in time; exactly one of calendar or rolling_days. A
    fiscal year is the calendar `fiscal_year` with the month it starts in (`start_month`, 1-12)."""

    calendar: str | None = None
    timezone: str = "UTC"
    rolling_days: int | None = None
    start_month: int | None = None

    def __post_init__(self) -> None:
        if (self.calendar is None) == (self.rolling_days is None):
            raise ValueError("a window has exactly one of calendar or rolling_days")
        if self.calendar is not None and self.calendar not in (*CALENDARS, FISCAL_YEAR):
            raise ValueError(f"calendar must be one of {', '.join((*CALENDARS, FISCAL_YEAR))}, not {self.calendar!r}")
        if (self.calendar == FISCAL_YEAR) != (self.start_month is not None):
            raise ValueError("a fiscal year, and only a fiscal year, has a start_month")
        if self.start_month is not None and not 1 <= self.start_month <= 12:
            raise ValueError(f"start_month must be a month, 1 to 12, not {self.start_month}")
        if self.rolling_days is not None and not 1 <= self.rolling_days <= 3660:
            raise ValueError("rolling_days must be between 1 and 3660")
        zone(self.timezone)

    @property
    def rolling(self) -> bool:
        return self.rolling_days is not None


@dataclass(frozen=True, slots=True)
class Window:
    """One concrete window, [start, end) in UTC, and the stable key the ledger files it under."""

    start: datetime
    end: datetime
    key: str

    def contains(self, at: datetime) -> bool:
        return self.start <= at < self.end


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; raises ValueError naming it when unknown."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        # OSError: a name that is a folder of the zone database (`Europe`), or too long a path.
        raise ValueError(f"unknown time zone {name!r}") from exc


def window_at(spec: WindowSpec, at: datetime) -> Window:
    """The window of `spec` that contains the instant `at` (which must be time-zone aware)."""
    if at.tzinfo is None:
        raise ValueError("instants must be time-zone aware")
    if spec.rolling_days is not None:
        # A rolling window has no fixed bounds: its ledger key is the rolling span itself, and
        # the reconciler ages consumption out of it as time moves.
        end = at.astimezone(UTC)
        return Window(end - timedelta(days=spec.rolling_days), end, f"rolling-{spec.rolling_days}d")
    local = at.astimezone(zone(spec.timezone))
    if spec.calendar == FISCAL_YEAR:
        start_local, end_local = fiscal_year_bounds(spec.start_month or 1, local)
    else:
        start_local, end_local = _calendar_bounds(spec.calendar or "", local)
    start, end = _instant(start_local), _instant(end_local)
    return Window(start, end, f"{_iso(start)}/{_iso(end)}")


def _calendar_bounds(calendar: str, local: datetime) -> tuple[datetime, datetime]:
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0, fold=0)
    if calendar == "day":
        start = midnight
        end = _add_days(start, 1)
    elif calendar == "week":  # ISO weeks start on Monday
        start = _add_days(midnight, -midnight.weekday())
        end = _add_days(start, 7)
    else:
        start = midnight.replace(day=1)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def fiscal_year_bounds(start_month: int, local: datetime) -> tuple[datetime, datetime]:
    """The local start and end of the fiscal year starting on the first of `start_month` that
    contains `local` (April: 1 April 2026 00:00 to 1 April 2027 00:00, local time)."""
    year = local.year if local.month >= start_month else local.year - 1
    start = local.replace(year=year, month=start_month, day=1, hour=0, minute=0, second=0, microsecond=0, fold=0)
    return start, start.replace(year=year + 1)


def _add_days(local: datetime, days: int) -> datetime:
    # Wall-clock arithmetic: adding a day across a DST change keeps local midnight.
    return (local.replace(tzinfo=None) + timedelta(days=days)).replace(tzinfo=local.tzinfo)


def _instant(local: datetime) -> datetime:
    # A local midnight that falls in a DST gap does not exist; normalising through UTC moves it
    # forward to the first instant that does, which is when the day really begins.
    return local.astimezone(UTC)


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso(at: datetime) -> str:
    """An instant as RFC 3339 UTC with a Z, seconds precision."""
    return _iso(at)


def rfc3339(at: datetime) -> str:
    """An instant as every HTTP answer writes it: RFC 3339 in UTC with a `Z`, fractions of a
    second only when there are any (the form pydantic gives response models too)."""
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")
