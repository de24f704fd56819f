"""Datetimes as protobuf Timestamps: the one conversion every message budgetgate writes uses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.core.metering import EARLIEST

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EARLIEST_SECOND = int((EARLIEST - EPOCH).total_seconds())
_LAST_SECOND = 253_402_300_799  # 9999-12-31T23:59:59Z, the last second a Timestamp may hold


def timestamp(at: datetime) -> Timestamp:
    """`at` as a Timestamp (a naive datetime is taken as UTC, as Timestamp.FromDatetime does).

    The same value FromDatetime gives, by integer arithmetic: FromDatetime goes through a time
    tuple and is slow, and this runs for every sample ingested and every decision announced."""
    seconds, nanos = _parts(at)
    return Timestamp(seconds=seconds, nanos=nanos)


def fill(stamp: Timestamp, at: datetime) -> None:
    """Set `stamp` (a message's field) to `at`, as `timestamp(at)` would be: a Timestamp given to
    a message's constructor is made and then copied into it."""
    stamp.seconds, stamp.nanos = _parts(at)


def _parts(at: datetime) -> tuple[int, int]:
    delta = (at if at.tzinfo is not None else at.replace(tzinfo=UTC)) - EPOCH
    return delta.days * 86_400 + delta.seconds, delta.microseconds * 1000


def maybe_timestamp(at: datetime | None) -> Timestamp | None:
    """`timestamp(at)`, or None (the field left unset) without a time."""
    return None if at is None else timestamp(at)


def accepted_time(stamp: Timestamp) -> datetime | None:
    """`stamp` as an aware datetime, or None when it is no time budgetgate takes: before
    EARLIEST, after the last second a Timestamp may hold, or with nanos out of range (what
    ToDatetime raises on, without its checks and time zone conversion)."""
    seconds, nanos = stamp.seconds, stamp.nanos  # each read of a field makes a new int
    if _EARLIEST_SECOND <= seconds <= _LAST_SECOND and 0 <= nanos < 1_000_000_000:
        return EPOCH + timedelta(0, seconds, nanos // 1000)
    return None


def time_problem(stamp: Timestamp, field: str) -> str | None:
    """Why `stamp` (the message's `field`) is no time budgetgate takes, if it is not one."""
    if accepted_time(stamp) is not None:
        return None
    return f"{field} is not a time from {EARLIEST.date().isoformat()} to 9999-12-31 (seconds {stamp.seconds}, nanos {stamp.nanos})"
