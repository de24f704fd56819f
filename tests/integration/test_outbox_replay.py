"""The outbox relay on real Postgres and Kafka: published rows stay for the replay window and are
pruned after it; a partition that lost what it acknowledged (here: its topic deleted and made
again, as a cluster restored from an older state would look) gets its rows of the window again,
found either by the periodic check of end offsets or by a new acknowledgement going backwards."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient

from budgetgate import outbox, topics, wire
from budgetgate.outbox import OutboxRelay
from budgetgate.topics import Topics, ensure_topics
from budgetgate.v1.policies_pb2 import PolicyBundlePublished
from tests.integration.test_consumer import drain


def announcement(n: int) -> wire.Record:
    message = PolicyBundlePublished(event_id=str(uuid.uuid4()), git_sha=f"{n:040x}")
    message.event_time.FromDatetime(datetime.now(UTC))
    return wire.encode(message, key=f"k{n}")


async def enqueue(pool: asyncpg.Pool, count: int, *, start: int = 0) -> None:
    async with pool.acquire() as conn, conn.transaction():
        for n in range(start, start + count):
            await outbox.enqueue(conn, topic=topics.POLICIES, record=announcement(n))


async def recreate(bootstrap: str, topic: str, prefix: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()
    await ensure_topics(bootstrap, prefix=prefix)


async def pending(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")


async def drain_all(relay: OutboxRelay) -> None:
    while await relay.relay_once():
        pass


async def test_rows_stay_for_the_window_and_are_pruned_after_it(settings, pg_dsn) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    relay = OutboxRelay(
        pool=pool, publisher=wire.Publisher(settings.kafka_bootstrap), topics=Topics(settings.topic_prefix), replay_window=timedelta(minutes=10)
    )
    try:
        await enqueue(pool, 6)
        await pool.execute("UPDATE outbox SET published_at = now() - interval '11 minutes' WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 2)")
        await pool.execute("UPDATE outbox SET published_at = now() - interval '9 minutes' WHERE id IN (SELECT id FROM outbox ORDER BY id OFFSET 2 LIMIT 2)")
        assert await relay.prune(limit=1) == 2
        assert await pool.fetchval("SELECT count(*) FROM outbox") == 4, "pending rows and those within the window stay"
    finally:
        await pool.close()


async def test_a_partition_that_forgot_is_found_by_its_end_offsets_and_gets_its_window_again(settings, pg_dsn) -> None:
    names = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    relay = OutboxRelay(pool=pool, publisher=wire.Publisher(settings.kafka_bootstrap), topics=names, check_seconds=3600)
    await relay.publisher.start()
    try:
        await enqueue(pool, 12)
        await drain_all(relay)
        assert await relay.check_broker() == 0, "nothing is replayed while the broker holds everything"
        partitions = await pool.fetchval("SELECT count(DISTINCT kafka_partition) FROM outbox")
        assert partitions > 1
        # Published before the window: the broker lost them too, but they are past replaying.
        await pool.execute("UPDATE outbox SET published_at = now() - interval '1 hour' WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 3)")
        await recreate(settings.kafka_bootstrap, names.policies, settings.topic_prefix)

        assert await relay.check_broker() == 9
        assert await pending(pool) == 9
        await drain_all(relay)
        assert await relay.check_broker() == 0, "a partition sent again is whole"
        on_topic = {wire.decode(PolicyBundlePublished, r.value, r.headers).git_sha for r in await drain(settings.kafka_bootstrap, names.policies, 9)}
        in_window = {r["key"] for r in await pool.fetch("SELECT key FROM outbox ORDER BY id OFFSET 3")}
        assert {f"{int(sha, 16)}" for sha in on_topic} == {k.removeprefix("k") for k in in_window}
    finally:
        await relay.publisher.stop()
        await relay.close()
        await pool.close()


async def test_an_acknowledgement_at_or_below_an_earlier_one_replays_the_partition(settings, pg_dsn) -> None:
    names = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    # No periodic check after the first: only the acknowledgements can tell.
    relay = OutboxRelay(pool=pool, publisher=wire.Publisher(settings.kafka_bootstrap), topics=names, check_seconds=3600)
    await relay.publisher.start()
    try:
        await enqueue(pool, 30)
        await drain_all(relay)
        await recreate(settings.kafka_bootstrap, names.policies, settings.topic_prefix)
        await enqueue(pool, 30, start=30)
        assert await relay.relay_once() == 30
        assert relay.replayed > 0 and await pending(pool) == relay.replayed
        await drain_all(relay)
        on_topic = await drain(settings.kafka_bootstrap, names.policies, 60)
        assert len({wire.decode(PolicyBundlePublished, r.value, r.headers).event_id for r in on_topic}) == 60
    finally:
        await relay.publisher.stop()
        await relay.close()
        await pool.close()


async def test_a_backlog_larger_than_a_batch_goes_out_whole_in_order_per_key(settings, pg_dsn) -> None:
    """BUDGETGATE_OUTBOX_BATCH rows per transaction: a backlog of several batches is published
    batch by batch, every row once, each key's rows in the order they were written."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    topic = Topics(settings.topic_prefix).name(topics.POLICIES)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    relay = OutboxRelay(pool=pool, publisher=wire.Publisher(settings.kafka_bootstrap), topics=Topics(settings.topic_prefix), batch=7)
    await relay.publisher.start()
    try:
        async with pool.acquire() as conn, conn.transaction():
            for n in range(30):  # three keys, ten rows each, interleaved
                message = PolicyBundlePublished(event_id=str(uuid.uuid4()), git_sha=f"{n:040x}")
                message.event_time.FromDatetime(datetime.now(UTC))
                await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(message, key=f"k{n % 3}"))
        published = [await relay.relay_once() for _ in range(6)]
        assert published == [7, 7, 7, 7, 2, 0] and await pending(pool) == 0
        found = await drain(settings.kafka_bootstrap, topic, expected=30)
        by_key: dict[bytes, list[int]] = {}
        for record in found:
            sent = PolicyBundlePublished.FromString(record.value)
            by_key.setdefault(record.key, []).append(int(sent.git_sha, 16))
        assert sorted(n for ns in by_key.values() for n in ns) == list(range(30))
        assert by_key == {f"k{k}".encode(): list(range(k, 30, 3)) for k in range(3)}
    finally:
        await relay.close()
        await relay.publisher.stop()
        await pool.close()
