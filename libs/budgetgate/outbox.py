"""The transactional outbox: a record written with the effect it announces, in the same
Postgres transaction (`enqueue`), and a relay that publishes committed rows to Kafka, in order,
at least once (`OutboxRelay`).

Rows are claimed with FOR UPDATE SKIP LOCKED, so several instances (of any service) can relay
side by side; a row is marked published only after the broker acknowledged it. Consumers
deduplicate on the event id, so a crash between the ack and the mark only causes a redelivery.
Rows name the topic without the deployment's prefix; the relay adds its own.
"""

from __future__ import annotations

import asyncio
import json
import logging

import asyncpg

from budgetgate import wire
from budgetgate.ledger.queries import sql
from budgetgate.topics import Topics

log = logging.getLogger(__name__)


async def enqueue(conn: asyncpg.Connection, *, topic: str, record: wire.Record) -> None:
    """Write `record` to the outbox in `conn`'s transaction, for `topic` (unprefixed name)."""
    await conn.execute(sql("insert_outbox"), *row(topic=topic, record=record))


def row(*, topic: str, record: wire.Record) -> tuple[str, str | None, bytes, str]:
    """The outbox columns (topic, key, payload, headers) of `record`, for a statement that
    writes the outbox row together with other changes."""
    # Header values are bytes; latin-1 maps each byte to one character and back unchanged.
    headers = json.dumps([[name, value.decode("latin-1")] for name, value in record.headers])
    key = record.key.decode("utf-8", errors="replace") if record.key is not None else None
    return topic, key, record.value, headers


class OutboxRelay:
    """Publishes the outbox, batch by batch, through `publisher` under `topics`' prefix."""

    def __init__(self, *, pool: asyncpg.Pool, publisher: wire.Publisher, topics: Topics, batch: int = 200, idle_seconds: float = 0.2) -> None:
        self.pool = pool
        self.publisher = publisher
        self.topics = topics
        self.batch = batch
        self.idle_seconds = idle_seconds
        self.wakeup = asyncio.Event()
        self.published = 0

    async def relay_once(self) -> int:
        """Publish one batch; returns how many rows were published."""
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(sql("claim_outbox"), self.batch)
            if not rows:
                return 0
            sends = [
                self.publisher.send_record(
                    self.topics.name(row["topic"]),
                    wire.Record(value=row["payload"], key=row["key"].encode() if row["key"] else None, headers=[(k, v.encode("latin-1")) for k, v in json.loads(row["headers"])]),
                )
                for row in rows
            ]
            # Sent together, acknowledged together: per-key order holds because one producer
            # sends them in id order to the partition of each key.
            await asyncio.gather(*sends)
            await conn.execute(sql("mark_published"), [row["id"] for row in rows])
        self.published += len(rows)
        return len(rows)

    async def serve(self) -> None:
        """Connect the publisher (waiting for Kafka as long as it takes), then `run`."""
        while True:
            try:
                await self.publisher.start()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Kafka may come later; the rows wait
                log.warning("Kafka not reachable yet (%s); outbox rows wait", exc)
                await asyncio.sleep(2)
        await self.run()

    async def run(self) -> None:
        """Relay until cancelled; backs off while Kafka or Postgres is unavailable."""
        delay = self.idle_seconds
        while True:
            try:
                sent = await self.relay_once()
                delay = self.idle_seconds
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the relay must outlive any outage
                log.warning("outbox relay failed, retrying in %.1fs: %s", delay, exc)
                sent = 0
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            if sent < self.batch:
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), timeout=self.idle_seconds)
                except TimeoutError:
                    pass
