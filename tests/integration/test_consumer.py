"""The inbox on real Kafka and Postgres, fed as the services feed it (a FastStream batch subscriber,
budgetgate.subscriber.apply_acked per poll): effects once, offsets after effects, poison to the
dead-letter topic, outages retried without skipping."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from budgetgate import wire
from budgetgate.consumer import BatchRoute, Delivery, Inbox, Poison, Route
from budgetgate.lag import ConsumerProgress
from budgetgate.subscriber import INBOX_SUBSCRIBER, apply_acked
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
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, handle)})
        assert await _consume(settings, inbox, group, 8) == 8

        rows = sorted(r["run_id"] for r in await pool.fetch("SELECT run_id FROM effects"))
        assert rows == ["a", "b", "flaky", "twice"]
        assert inbox.duplicates == 1 and inbox.dead_lettered == 3 and failures["left"] == 0
        dead = await drain(settings.kafka_bootstrap, dlq(topics.lifecycle), 3)
        reasons = sorted(wire.header(r.headers, "dlq-reason").decode() for r in dead)
        assert len(reasons) == 3 and any("cannot store" in r for r in reasons)
        assert any("poison" in r for r in reasons) and any("protobuf" in r.lower() or "parse" in r.lower() for r in reasons)

        # The group's offsets were committed after the effects: a restart reads nothing again.
        again = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, handle)})
        assert await _consume(settings, again, group, 1, timeout=3) == 0
    await pool.close()


async def _publish(settings, topic: str, messages: list) -> None:  # type: ignore[no-untyped-def,type-arg]
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        await asyncio.gather(*(publisher.send(topic, m, key="one-partition") for m in messages))


async def _consume(settings, inbox: Inbox, group: str, expected: int, *, progress: ConsumerProgress | None = None, timeout: float = 30) -> int:  # type: ignore[no-untyped-def]
    """Feed `inbox` from its topics in consumer group `group` as the services do (one FastStream
    batch subscriber, `apply_acked` per poll) until `expected` records are taken care of or
    `timeout` seconds passed; the number taken care of."""
    taken = 0
    enough = asyncio.Event()
    broker = KafkaBroker(settings.kafka_bootstrap)

    @broker.subscriber(*inbox.routes, group_id=group, **INBOX_SUBSCRIBER)
    async def apply(message: KafkaMessage) -> None:
        nonlocal taken
        taken += (await apply_acked(inbox, message, progress=progress)).records
        if taken >= expected:
            enough.set()

    await broker.start()
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), timeout)
    finally:
        await broker.stop()
    return taken


async def _committed(bootstrap: str, group: str, topic: str) -> int | None:
    """The offset group `group` has committed on partition 0 of `topic` (None: nothing yet)."""
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await reader.start()
    try:
        return await reader.committed(TopicPartition(topic, 0))
    finally:
        await reader.stop()


def _batch_route(seen: list[list[str]]) -> BatchRoute:
    """Writes every message's run id with one statement; refuses 'refused', names 'poison' as
    poison, and lets Postgres refuse 'overflow'."""

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> dict[Delivery, str]:
        seen.append([d.message.run_id for d in deliveries])
        for delivery in deliveries:
            if delivery.message.run_id == "poison":
                raise Poison("run id 'poison' is not acceptable", delivery=delivery)
        refused = {d: "refused by the handler" for d in deliveries if d.message.run_id == "refused"}
        kept = [d for d in deliveries if d not in refused]
        if any(d.message.run_id == "overflow" for d in kept):
            await conn.fetchval("SELECT $1::int", 2**40)
        await conn.executemany("INSERT INTO effects VALUES ($1, $2)", [(d.message.run_id, d.message.event_id) for d in kept])
        return refused

    return BatchRoute(lifecycle_pb2.LifecycleEvent, handle)


async def test_batch_with_poison_in_the_middle_commits_the_others_once(settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, event_id text NOT NULL UNIQUE)")
    twice = event("twice")
    names = ["a", "poison", "b", "refused", "c", "overflow", "d"]
    await _publish(settings, topics.lifecycle, [event(n) for n in names[:3]] + [twice, twice] + [event(n) for n in names[3:]])
    seen: list[list[str]] = []
    group = f"g-{uuid.uuid4().hex[:8]}"
    reader = InMemoryMetricReader()
    progress = ConsumerProgress(MeterProvider(metric_readers=[reader]).get_meter("test"), name="test")
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: _batch_route(seen)})
        assert await _consume(settings, inbox, group, 9, progress=progress) == 9
    rows = sorted(r["run_id"] for r in await pool.fetch("SELECT run_id FROM effects"))
    assert rows == ["a", "b", "c", "d", "twice"]
    assert inbox.dead_lettered == 3 and inbox.duplicates == 1 and inbox.processed == 5
    assert max(len(batch) for batch in seen) > 1, "the handler was never given a batch"
    reasons = sorted(wire.header(r.headers, wire.DLQ_REASON).decode() for r in await drain(settings.kafka_bootstrap, dlq(topics.lifecycle), 3))
    assert len(reasons) == 3 and any("cannot store" in r for r in reasons) and any("poison" in r for r in reasons) and "refused by the handler" in reasons
    # Refused and poison messages keep no inbox row: a redelivery finds them poison again.
    inbox = {r["event_id"] for r in await pool.fetch("SELECT event_id FROM inbox WHERE consumer = 'test'")}
    effect_ids = {r["event_id"] for r in await pool.fetch("SELECT event_id FROM effects")}
    assert inbox == effect_ids
    assert await _committed(settings.kafka_bootstrap, group, topics.lifecycle) == 9
    # What the consumer showed: every record counted, nothing left behind, the lag of the five applied.
    points = {m.name: list(m.data.data_points) for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert sum(p.value for p in points["budgetgate_consumer_records"]) == 9
    assert [(p.attributes["partition"], p.value) for p in points["budgetgate_consumer_lag_records"]] == [("0", 0)]
    assert sum(p.count for p in points["budgetgate_consumer_event_lag"]) == 5
    await pool.close()


async def test_redelivered_batch_changes_nothing(settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, event_id text NOT NULL UNIQUE)")
    await _publish(settings, topics.lifecycle, [event(f"run-{i}") for i in range(20)])
    seen: list[list[str]] = []
    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        # A second group reads the same records again: the inbox (same name) takes every one as a duplicate.
        for attempt in range(2):
            inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: _batch_route(seen)})
            assert await _consume(settings, inbox, f"g-{attempt}-{uuid.uuid4().hex[:8]}", 20) == 20
            assert inbox.processed == (20 if attempt == 0 else 0)
            assert inbox.duplicates == (0 if attempt == 0 else 20)
    assert await pool.fetchval("SELECT count(*) FROM effects") == 20
    assert sum(len(batch) for batch in seen) == 20, "a duplicate reached the handler"
    await pool.close()


async def test_offsets_committed_only_after_the_postgres_commit(settings, pg_dsn) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, event_id text NOT NULL UNIQUE)")
    await _publish(settings, topics.lifecycle, [event(f"run-{i}") for i in range(5)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    inside, release = asyncio.Event(), asyncio.Event()
    outages = {"left": 1}

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> None:
        await conn.executemany("INSERT INTO effects VALUES ($1, $2)", [(d.message.run_id, d.message.event_id) for d in deliveries])
        inside.set()
        await release.wait()
        if outages["left"]:
            outages["left"] -= 1
            raise ConnectionError("Postgres went away before the commit")

    async with wire.Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: BatchRoute(lifecycle_pb2.LifecycleEvent, handle)})
        polling = asyncio.create_task(_consume(settings, inbox, group, 5, timeout=60))
        try:
            await asyncio.wait_for(inside.wait(), 30)
            # The handler has written its effects but the transaction is open: nothing committed anywhere.
            assert await _committed(settings.kafka_bootstrap, group, topics.lifecycle) is None
            assert await pool.fetchval("SELECT count(*) FROM inbox") == 0
            release.set()
            assert await polling == 5
        finally:
            release.set()
            await asyncio.gather(polling, return_exceptions=True)
    # The outage rolled the first try back; the retry committed every effect once, then the offset.
    assert outages["left"] == 0
    assert await pool.fetchval("SELECT count(*) FROM effects") == 5
    assert await _committed(settings.kafka_bootstrap, group, topics.lifecycle) == 5
    await pool.close()
