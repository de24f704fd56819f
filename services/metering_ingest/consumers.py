"""metering-ingest's Kafka side, declared once (`subscription`): metering.samples.v1 read by a
batch subscriber, each poll applied by the inbox (budgetgate.messaging.inbox.Inbox) in one
Postgres transaction, and acknowledged (its offsets committed) only after that commit;
budgetgate.messaging.subscriber says how FastStream is used for that, and where it is not enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import asyncpg
from budgetgate.messaging.inbox import BatchRoute, Delivery, locks_taken
from budgetgate.core.metering import Rejected, Sample, usage_event_id
from budgetgate.services.metering_ingest.ingest import FOLDED, Ingestor, RecordOrigin
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.messaging.subscriber import Subscription
from budgetgate.contracts.topics import Topics
from budgetgate.v1.metering_pb2 import MeteringSample

if TYPE_CHECKING:
    from budgetgate.services.metering_ingest.service import MeteringService


def subscription(settings: MeteringSettings, topics: Topics) -> Subscription[MeteringService]:
    """What metering-ingest consumes: metering samples, by `consumer_concurrency` consumers of one
    group in one process, each owning some of the partitions (as processes side by side would):
    while one waits for Postgres, another works. Each partition still has one owner, so its
    records are applied in order."""
    return Subscription(
        routes={topics.metering: lambda service: metering_route(service.ingestor, service.metrics)},
        group_id=settings.group_id,
        group_timing=settings.kafka_group_timing,
        max_records=settings.consumer_max_records,
        title="metering.samples.v1:metering-ingest",
        description=(
            "Metering samples (budgetgate.v1.MeteringSample, binary protobuf or its canonical JSON mapping) become usage rows "
            "and usage.records.v1 messages; poison goes to metering.samples.v1.dlq with the reason."
        ),
        pipelined=settings.consumer_pipelined,
        workers=settings.consumer_concurrency,
    )


def metering_route(ingestor: Ingestor, metrics: MeteringMetrics) -> BatchRoute:
    """metering.samples.v1 for the inbox: a batch of samples placed together; a sample that is
    rejected (invalid, a conflict, a regression, a run that never got a decision) is refused.
    Tracked by offsets, with no inbox row per sample: a sample's id keeps it from being applied
    twice (a sample delivered again is a duplicate of itself, or pending already), so each poll
    records only the offsets it applied per partition (budgetgate.messaging.inbox)."""

    def prepare(deliveries: Sequence[Delivery]) -> None:
        # While the poll before is in Postgres: each sample validated, with its usage record's
        # event id (which the poll's statement sends for every sample).
        now = ingestor.clock()
        for delivery in deliveries:
            delivery.prepared = _prepared(ingestor, delivery.message, now)

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> Mapping[Delivery, str]:
        refused: dict[Delivery, str] = {}
        valid: list[Delivery] = []
        batch: list[tuple[Sample, RecordOrigin]] = []
        event_ids: list[str] = []
        now = ingestor.clock()
        for delivery in deliveries:
            prepared = delivery.prepared or _prepared(ingestor, delivery.message, now)
            if isinstance(prepared, Rejected):
                refused[delivery] = str(prepared)
                continue
            sample, event_id = prepared
            valid.append(delivery)
            batch.append((sample, RecordOrigin(delivery.record)))
            event_ids.append(event_id)
        outcomes = await ingestor.place_batch(conn, batch, locked=locks_taken, event_ids=event_ids, every=False)
        placed, folded = [], 0
        for delivery, outcome in zip(valid, outcomes, strict=True):
            if outcome is FOLDED:  # most of a poll's samples: counted, not looked at
                folded += 1
            elif isinstance(outcome, Rejected):
                refused[delivery] = str(outcome)
            else:
                placed.append(outcome)
        # Counted when placed: a batch retried after an outage counts its samples again.
        metrics.outcomes(placed, source="kafka", folded=folded)
        return refused

    return BatchRoute(MeteringSample, handle, prepare, offsets=True)


def _prepared(ingestor: Ingestor, message: MeteringSample, now: datetime) -> tuple[Sample, str] | Rejected:
    """The validated sample and its usage record's event id, or why it is refused."""
    try:
        sample = ingestor.validate(message, now=now)
    except Rejected as exc:
        return exc
    return sample, usage_event_id(sample.run_id, sample.sample_id)
