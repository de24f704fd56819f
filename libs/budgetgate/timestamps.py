"""Datetimes as protobuf Timestamps: the one conversion every message budgetgate writes uses."""

from __future__ import annotations

from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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
