"""metering-ingest's Kafka side: one FastStream router with a batch subscriber on
metering.samples.v1. Each poll is applied by the inbox (budgetgate.consumer.Inbox) in one Postgres
transaction, and acknowledged (its offsets committed) only after that commit.

How FastStream is used, and where it is not enough for the inbox pattern:
- `batch=True, max_records`: one poll, one list of records, one transaction.
- `ack_policy=AckPolicy.MANUAL` and `message.ack()` after `Inbox.apply` returned: the ack commits
  the position of every partition the consumer has returned records of, and all of those are
  durable by then (effects, inbox rows, dead letters). An outage never leaves the handler:
  `Inbox.apply` retries the batch in place. Should the handler fail anyway, it nacks, and
  FastStream seeks every partition of the batch back to its first record: nothing is skipped.
  (A handler that raised without a nack would be skipped: the next batch's ack commits past it.)
- `parser=keep_header_bytes`: FastStream's batch parser decodes every header value as UTF-8 and,
  when one is not, fails the whole batch before the handler runs, so with manual acks the poison
  record and every good one polled with it would be skipped silently (seen on Tansu and Kafka
  alike: a header is bytes to Kafka). The parser hands FastStream header values it can decode
  and keeps the records as they came in `raw_message`, which is what the inbox reads.
- The poison handling itself (decode, dead-letter topic, the others committed once) is the
  inbox's: FastStream's own exception handling would ack or nack the batch as a whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
from aiokafka import ConsumerRecord
from faststream.kafka import KafkaRouter
from faststream.kafka.annotations import KafkaMessage
from faststream.middlewares import AckPolicy

from budgetgate.consumer import BatchRoute, Delivery
from budgetgate.core.metering import Rejected
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.topics import Topics
from budgetgate.v1.metering_pb2 import MeteringSample

if TYPE_CHECKING:
    from budgetgate.services.metering_ingest.app import Runtime


def router(*, settings: MeteringSettings, topics: Topics, runtime: Callable[[], Runtime]) -> KafkaRouter:
    """The service's Kafka subscribers; `runtime()` gives what the service holds while it runs."""
    kafka = KafkaRouter()

    async def metering_samples(message: KafkaMessage) -> None:
        rt = runtime()
        records: Sequence[ConsumerRecord] = message.raw_message
        started = time.perf_counter()
        try:
            applied = await rt.inbox.apply(records)
        except BaseException:
            await message.nack()
            raise
        await message.ack()
        rt.progress.batch(applied, seconds=time.perf_counter() - started, topics=(r.topic for r in records))
        await rt.progress.refresh(message.consumer)

    # Several consumers of one group in one process, each owning some of the partitions (as
    # processes side by side would): while one waits for Postgres, another works. Each
    # partition still has one owner, so its records are applied in order.
    for worker in range(settings.consumer_concurrency):
        kafka.subscriber(
            topics.metering,
            batch=True,
            max_records=settings.consumer_max_records,
            group_id=settings.consumer_group,
            auto_offset_reset="earliest",
            ack_policy=AckPolicy.MANUAL,
            parser=keep_header_bytes,
            decoder=raw_bodies,
            title=f"metering.samples.v1:metering-ingest#{worker}" if worker else "metering.samples.v1:metering-ingest",
            description="Metering samples (budgetgate.v1.MeteringSample, binary protobuf or its canonical JSON mapping) become usage rows and usage.records.v1 messages; poison goes to metering.samples.v1.dlq with the reason.",
            include_in_schema=worker == 0,
        )(metering_samples)

    return kafka


async def keep_header_bytes(records: tuple[ConsumerRecord, ...], parse: Callable[[tuple[ConsumerRecord, ...]], Awaitable[Any]]) -> Any:
    """FastStream's batch parser, given header values it can decode; the records as they came."""
    readable = tuple(r if _utf8(r.headers) else dataclasses.replace(r, headers=[(k, v.decode("utf-8", errors="replace").encode()) for k, v in r.headers]) for r in records)
    message = await parse(readable)
    message.raw_message = records
    return message


def _utf8(headers: Sequence[tuple[str, bytes]] | None) -> bool:
    try:
        for _, value in headers or ():
            value.decode()
    except UnicodeDecodeError:
        return False
    return True


async def raw_bodies(message: Any, _decode: Callable[[Any], Awaitable[Any]]) -> Any:
    """The record values as they are: the inbox decodes them (protobuf or its JSON mapping)."""
    return message.body


def metering_route(ingestor: Ingestor, metrics: MeteringMetrics) -> BatchRoute:
    """metering.samples.v1 for the inbox: a batch of samples placed together; a sample that is
    rejected (invalid, a conflict, a regression, a run that never got a decision) is refused."""

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> Mapping[Delivery, str]:
        refused: dict[Delivery, str] = {}
        valid: list[tuple[Delivery, Any, Origin]] = []
        now = ingestor.clock()
        for delivery in deliveries:
            record = delivery.record
            try:
                sample = ingestor.validate(delivery.message, now=now)
            except Rejected as exc:
                refused[delivery] = str(exc)
                continue
            origin = Origin(source="kafka", topic=record.topic, payload=record.value, headers=tuple(record.headers or ()), partition=record.partition, offset=record.offset)
            valid.append((delivery, sample, origin))
        outcomes = await ingestor.place_batch(conn, [(sample, origin) for _, sample, origin in valid])
        placed = []
        for (delivery, _, _), outcome in zip(valid, outcomes, strict=True):
            if isinstance(outcome, Rejected):
                refused[delivery] = str(outcome)
            else:
                placed.append(outcome)
        # Counted when placed: a batch retried after an outage counts its samples again.
        metrics.outcomes(placed, source="kafka")
        return refused

    return BatchRoute(MeteringSample, handle)
