"""The inbox consumer on real Kafka and Postgres: effects once, offsets after effects, poison
to the dead-letter topic, outages retried without skipping."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate import wire
from budgetgate.consumer import InboxConsumer, Poison, Route
from budgetgate.topics import Topics, dlq, ensure_topics
from budgetgate.v1 import lifecycle_pb2


def event(run_id: str, event_id: str | None = None) -> lifecycle_pb2.LifecycleEvent:
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return lifecycle_pb2.LifecycleEvent(event_id=event_id or str(uuid.uuid4()), event_time=stamp, run_id=run_id, type=lifecycle_pb2.STARTED)


async def drain(bootstrap: str, topic: str, expected: int, timeout: float = 20) -> list:  # type: ignore[type-arg]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        while not partitions:
            await consumer._client.force_metadata_update()  # noqa: SLF001
            partitions = consumer.partitions_for_topic(topic) or set()
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        await consumer.seek_to_beginning()
        found: list = []  # type: ignore[type-arg]
        deadline = asyncio.get_running_loop().time() + timeout
        while len(found) < expected and asyncio.get_running_loop().time() < deadline:
            for records in (await consumer.getmany(timeout_ms=300)).values():
                found.extend(records)
        return found
    finally:
        await consumer.stop()


async def test_effects_once_poison_to_dlq_outage_retried(settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, event_id text NOT NULL)")
    failures = {"left": 2}

    async def handle(conn: asyncpg.Connection, message: lifecycle_pb2.LifecycleEvent, _record: object) -> None:
        if message.run_id == "poison":
            raise Poison("run id 'poison' is not acceptable")
        if message.run_id == "overflow":
            await conn.fetchval("SELECT $1::int", 2**40)  # Postgres refuses the data itself
        if message.run_id == "flaky" and failures["left"] > 0:
            failures["left"] -= 1
            raise ConnectionError("Postgres went away")
        await conn.execute("INSERT INTO effects VALUES ($1, $2)", message.run_id, message.event_id)

    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        duplicate = event("twice")
        for message in [event("a"), duplicate, duplicate, event("poison"), event("overflow"), event("flaky"), event("b")]:
            await publisher.send(topics.lifecycle, message, key=message.run_id)
        raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
        await raw.start()
        await raw.send_and_wait(topics.lifecycle, b"\x00not protobuf", headers=[("content-type", b"application/x-protobuf")])
        await raw.stop()

        group = f"g-{uuid.uuid4().hex[:8]}"
        consumer = InboxConsumer(name="test", group=group, bootstrap=settings.kafka_bootstrap, pool=pool, publisher=publisher, routes={topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, handle)})
        await consumer.start()
        try:
            taken = 0
            deadline = asyncio.get_running_loop().time() + 30
            while taken < 8 and asyncio.get_running_loop().time() < deadline:
                taken += await consumer.poll_once()
        finally:
            await consumer.stop()
        assert taken == 8

        rows = sorted(r["run_id"] for r in await pool.fetch("SELECT run_id FROM effects"))
        assert rows == ["a", "b", "flaky", "twice"]
        assert consumer.duplicates == 1 and consumer.dead_lettered == 3 and failures["left"] == 0
        dead = await drain(settings.kafka_bootstrap, dlq(topics.lifecycle), 3)
        reasons = sorted(wire.header(r.headers, "dlq-reason").decode() for r in dead)
        assert len(reasons) == 3 and any("cannot store" in r for r in reasons)
        assert any("poison" in r for r in reasons) and any("protobuf" in r.lower() or "parse" in r.lower() for r in reasons)

        # The group's offsets were committed after the effects: a restart reads nothing again.
        again = InboxConsumer(name="test", group=group, bootstrap=settings.kafka_bootstrap, pool=pool, publisher=publisher, routes={topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, handle)})
        await again.start()
        try:
            assert await again.poll_once(timeout_ms=3000) == 0
        finally:
            await again.stop()
    await pool.close()
