"""The one way budgetgate consumes Kafka: each message's effect and its inbox row are committed
in one Postgres transaction, and the Kafka offset only after that (invariant 5); a message that
cannot be used goes to the topic's dead-letter topic with the reason (invariant 6).

A service supplies a `Handler` per topic. The handler runs inside the transaction, gets the
decoded message, and either does its work through the connection, or raises `Poison` for a
message that will never be usable (it goes to the DLQ, and the consumer moves on). Any other
exception is taken as a passing outage: the partition is rewound to the message and retried
with capped backoff, so nothing is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from budgetgate import wire

log = logging.getLogger(__name__)
tracer = trace.get_tracer("budgetgate.consumer")

Handler = Callable[[asyncpg.Connection, Any, ConsumerRecord], Awaitable[None]]


class Poison(ValueError):
    """A message that can never be processed; `reason` goes with it to the dead-letter topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Route:
    """How one topic is read: its message class and the handler of each message."""

    message: type[Message]
    handler: Handler


class InboxConsumer:
    """Consumes `routes` (topic → Route) in consumer group `group`; `name` keys the inbox."""

    def __init__(
        self,
        *,
        name: str,
        group: str,
        bootstrap: str,
        pool: asyncpg.Pool,
        publisher: wire.Publisher,
        routes: Mapping[str, Route],
        max_backoff: float = 10.0,
        on_dead_letter: Callable[[str, str], None] | None = None,
    ) -> None:
        self.name = name
        self.group = group
        self.bootstrap = bootstrap
        self.pool = pool
        self.publisher = publisher
        self.routes = dict(routes)
        self.max_backoff = max_backoff
        self.on_dead_letter = on_dead_letter
        self.processed = 0
        self.duplicates = 0
        self.dead_lettered = 0
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            *self.routes,
            bootstrap_servers=self.bootstrap,
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            client_id=self.name,
        )
        await self._consumer.start()

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await consumer.stop()

    async def run(self) -> None:
        """Consume until cancelled."""
        if self._consumer is None:
            await self.start()
        while True:
            await self.poll_once()

    async def poll_once(self, timeout_ms: int = 500) -> int:
        """Process what one poll returns; returns the number of records taken care of."""
        assert self._consumer is not None, "start() first"
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=500)
        done = 0
        for partition, records in batches.items():
            done += await self._partition(partition, records)
        return done

    async def _partition(self, partition: TopicPartition, records: list[ConsumerRecord]) -> int:
        assert self._consumer is not None
        delay = 0.2
        index = 0
        while index < len(records):
            record = records[index]
            try:
                await self._one(record)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - an outage: retry this very record
                log.warning("%s: %s[%d]@%d failed, retrying in %.1fs: %s", self.name, record.topic, record.partition, record.offset, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
                continue
            delay = 0.2
            index += 1
        # Only now: every record up to here has its effect (or its DLQ copy) durable.
        await self._consumer.commit({partition: records[-1].offset + 1})
        return len(records)

    async def _one(self, record: ConsumerRecord) -> None:
        route = self.routes[record.topic]
        try:
            message = wire.decode(route.message, record.value, record.headers)
        except wire.WireError as exc:
            await self._dead_letter(record, exc.reason)
            return
        parent = wire.context_from_headers(record.headers)
        with tracer.start_as_current_span(f"consume {record.topic}", context=parent, kind=SpanKind.CONSUMER):
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    fresh = await conn.fetchval(
                        "INSERT INTO inbox (consumer, event_id, topic) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING RETURNING true",
                        self.name,
                        message.event_id,
                        record.topic,
                    )
                    if not fresh:
                        self.duplicates += 1
                        return
                    await route.handler(conn, message, record)
            except Poison as exc:
                await self._dead_letter(record, exc.reason)
                return
            except asyncpg.DataError as exc:
                # Postgres refuses the message's own data (class 22: a value out of range, an
                # invalid byte): retrying cannot help, so it is poison, not an outage.
                await self._dead_letter(record, f"data Postgres cannot store: {type(exc).__name__}: {exc}")
                return
        self.processed += 1

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        log.warning("%s: %s[%d]@%d to the dead-letter topic: %s", self.name, record.topic, record.partition, record.offset, reason)
        await self.publisher.send_dead_letter(record, reason=reason)
        self.dead_lettered += 1
        if self.on_dead_letter is not None:
            self.on_dead_letter(record.topic, reason)
