"""budgetgate.contracts.timestamps gives exactly what protobuf's own conversion gives, for any datetime."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from budgetgate.contracts.timestamps import fill, maybe_timestamp, timestamp
from budgetgate.v1.usage_pb2 import UsageRecord

# The range a Timestamp holds, minus a day on each side for time zone offsets.
instants = st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30))
zones = st.none() | st.just(UTC) | st.builds(lambda m: timezone(timedelta(minutes=m)), st.integers(-23 * 60 - 59, 23 * 60 + 59))


@given(instants, zones)
def test_timestamp_is_from_datetime(at: datetime, zone: timezone | None) -> None:
    at = at if zone is None else at.replace(tzinfo=zone)
    expected = Timestamp()
    expected.FromDatetime(at)
    assert timestamp(at) == expected
    assert maybe_timestamp(at) == expected
    record = UsageRecord()
    fill(record.observed_at, at)
    assert record.observed_at == expected


def test_no_time_leaves_the_field_unset() -> None:
    assert maybe_timestamp(None) is None
