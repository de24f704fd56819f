"""The consumer's event-lag histogram: every message of a small batch is timed, a large batch
has TIMED_PER_BATCH of its messages timed, spread over it; every record is counted."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from aiokafka import ConsumerRecord
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from budgetgate.messaging.inbox import Applied, Delivery
from budgetgate.messaging.lag import TIMED_PER_BATCH, ConsumerProgress
from budgetgate.v1.metering_pb2 import MeteringSample

COMMITTED = datetime(2025, 3, 1, 12, tzinfo=UTC)


def _batch(size: int) -> Applied:
    deliveries = []
    for index in range(size):
        message = MeteringSample(event_id=f"e{index}")
        message.event_time.FromDatetime(COMMITTED - timedelta(seconds=index))  # the i-th is i seconds old
        record = ConsumerRecord("metering", 0, index, 0, 0, None, b"", None, 0, 0, ())
        deliveries.append(Delivery(message, record))
    return Applied(records=size, processed=size, committed=deliveries)


def _lags(batch: Applied) -> tuple[int, float, float]:
    reader = InMemoryMetricReader()
    progress = ConsumerProgress(MeterProvider(metric_readers=[reader]).get_meter("test"), name="test")
    progress.batch(batch, seconds=0.1, topics=["metering"] * batch.records, committed_at=COMMITTED)
    metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    [lag] = metrics["budgetgate_consumer_event_lag"].data.data_points
    [records] = metrics["budgetgate_consumer_records"].data.data_points
    assert records.value == batch.records
    return lag.count, lag.min, lag.max


def test_every_message_of_a_small_batch_is_timed() -> None:
    assert _lags(_batch(TIMED_PER_BATCH)) == (TIMED_PER_BATCH, 0.0, TIMED_PER_BATCH - 1)


def test_a_large_batch_is_timed_on_a_sample_spread_over_it() -> None:
    count, youngest, oldest = _lags(_batch(TIMED_PER_BATCH * 7 + 3))
    assert count == TIMED_PER_BATCH
    # From the first message to within one step of the last: the sample spans the batch.
    assert youngest == 0.0 and oldest >= TIMED_PER_BATCH * 7 + 3 - 8
