"""How far behind a consumer is, for Prometheus (issue 9, item 7). On /metrics:

- `budgetgate_consumer_event_lag_seconds{consumer,topic}` (histogram): from a message's event
  time (for metering: when the exporter took the sample) to the commit of its effect (the ledger).
  Of a batch of more than `TIMED_PER_BATCH` messages, that many are timed, spread evenly over it:
  one histogram record costs more than the rest of a message's bookkeeping, and a sample of each
  batch keeps the distribution (`budgetgate_consumer_records_total` counts every message).
- `budgetgate_consumer_lag_records{consumer,topic,partition}` (gauge): records not consumed yet
  per assigned partition (the partition's end offset minus the consumer's position), as of the
  last batch.
- `budgetgate_consumer_batch_records{consumer}` (histogram): records per batch (per poll).
- `budgetgate_consumer_records_total{consumer,topic}`: records taken care of (applied,
  duplicate or dead-lettered); its rate is records/s.
- `budgetgate_consumer_batch_seconds{consumer}` (histogram): time to apply and commit a batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import IllegalStateError
from opentelemetry.metrics import CallbackOptions, Meter, Observation

from budgetgate.messaging.inbox import Applied

_LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
_BATCH_BUCKETS = (1, 5, 10, 50, 100, 250, 500, 1000, 2000, 5000)
TIMED_PER_BATCH = 100
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ConsumerProgress:
    """The instruments of one consumer (`name`, as its inbox is named)."""

    def __init__(self, meter: Meter, *, name: str) -> None:
        self.name = name
        self._event_lag = meter.create_histogram(
            "budgetgate_consumer_event_lag", unit="s", explicit_bucket_boundaries_advisory=_LAG_BUCKETS,
            description="from a message's event time to the commit of its effect",
        )  # fmt: skip
        self._batch = meter.create_histogram(
            "budgetgate_consumer_batch_records", explicit_bucket_boundaries_advisory=_BATCH_BUCKETS, description="records per batch (one poll, one transaction)"
        )
        self._batch_seconds = meter.create_histogram(
            "budgetgate_consumer_batch", unit="s", explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS, description="time to apply and commit one batch"
        )
        self._records = meter.create_counter("budgetgate_consumer_records", description="records taken care of (applied, duplicate or dead-lettered)")
        self._behind: dict[int, dict[TopicPartition, int]] = {}  # per consumer (several may share a process)
        meter.create_observable_gauge(
            "budgetgate_consumer_lag_records",
            callbacks=[self._observe_lag],
            description="records not consumed yet, per assigned partition (end offset minus position)",
        )

    def batch(self, applied: Applied, *, seconds: float, topics: Iterable[str], committed_at: datetime | None = None) -> None:
        """Count one committed batch (`topics`: the topic of each of its records)."""
        at = (committed_at or datetime.now(UTC)).timestamp()
        self._batch.record(applied.records, {"consumer": self.name})
        self._batch_seconds.record(seconds, {"consumer": self.name})
        for topic, count in Counter(topics).items():
            self._records.add(count, {"consumer": self.name, "topic": topic})
        labels: dict[str, dict[str, str]] = {}
        record = self._event_lag.record
        committed = applied.committed
        if len(committed) > TIMED_PER_BATCH:
            step = len(committed) / TIMED_PER_BATCH
            committed = [committed[int(k * step)] for k in range(TIMED_PER_BATCH)]
        for delivery in committed:
            message = delivery.message
            if message.HasField("event_time"):
                topic = delivery.record.topic
                sent = message.event_time.seconds + message.event_time.nanos / 1e9
                record(max(at - sent, 0.0), labels.get(topic) or labels.setdefault(topic, {"consumer": self.name, "topic": topic}))

    async def polled(self, applied: Applied, *, seconds: float, records: Iterable[ConsumerRecord], consumer: AIOKafkaConsumer | None) -> None:
        """Count one committed poll (`batch`) and read the lag of `consumer` afresh (`refresh`)."""
        self.batch(applied, seconds=seconds, topics=(r.topic for r in records))
        await self.refresh(consumer)

    async def refresh(self, consumer: AIOKafkaConsumer | None) -> None:
        """Read the lag of each partition assigned to `consumer` (no broker round trip: the end
        offsets come with every fetch); partitions it no longer has are forgotten, also one a
        rebalance takes while this reads (the poll it follows is committed all the same)."""
        if consumer is None:
            return
        behind = {}
        for partition in consumer.assignment():
            end = consumer.highwater(partition)
            if end is None:
                continue
            try:
                behind[partition] = max(0, end - await consumer.position(partition))
            except IllegalStateError:  # revoked meanwhile
                continue
        self._behind[id(consumer)] = behind

    def _observe_lag(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(lag, {"consumer": self.name, "topic": tp.topic, "partition": str(tp.partition)})
            for each in self._behind.values()
            for tp, lag in each.items()
        ]
