"""The outbox relay on real Postgres and Kafka: published rows stay for the replay window and are
pruned after it; a partition that lost what it acknowledged (here: its topic deleted and made
again, as a cluster restored from an older state would look) gets its rows of the window again,
found either by the periodic check of end offsets or by a new acknowledgement going backwards.
A bundle row goes out record by record, in order among single rows, and comes back whole when
any partition its records went to forgot them."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient

from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging import outbox
from budgetgate.contracts import topics, wire
from budgetgate.messaging.outbox import OutboxRelay
from budgetgate.runtime.settings import CommonSettings
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.policies_pb2 import PolicyBundlePublished
from tests.support.kafka import drain


def announcement(n: int) -> wire.Record:
    return wire.encode(_announced(n), key=f"k{n}")


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


@contextlib.asynccontextmanager
async def relaying(settings: CommonSettings, pg_dsn: str, **options: Any) -> AsyncIterator[tuple[asyncpg.Pool, OutboxRelay]]:
    """A pool on `pg_dsn` and a started relay publishing under the test's prefix (`options`:
    batch, check_seconds, replay_window...), stopped after."""
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    relay = OutboxRelay(pool=pool, publisher=Publisher(settings.kafka_bootstrap), topics=Topics(settings.topic_prefix), **options)
    await relay.publisher.start()
    try:
        yield pool, relay
    finally:
        await relay.publisher.stop()
        await relay.close()
        await pool.close()


async def drain_all(relay: OutboxRelay) -> None:
    while await relay.relay_once():
        pass


async def test_rows_stay_for_the_window_and_are_pruned_after_it(settings, pg_dsn) -> None:
    async with relaying(settings, pg_dsn, replay_window=timedelta(minutes=10)) as (pool, relay):
        await enqueue(pool, 6)
        await pool.execute("UPDATE outbox SET published_at = now() - interval '11 minutes' WHERE id IN (SELECT id FROM outbox ORDER BY id LIMIT 2)")
        await pool.execute("UPDATE outbox SET published_at = now() - interval '9 minutes' WHERE id IN (SELECT id FROM outbox ORDER BY id OFFSET 2 LIMIT 2)")
        assert await relay.prune(limit=1) == 2
        assert await pool.fetchval("SELECT count(*) FROM outbox") == 4, "pending rows and those within the window stay"


async def test_a_partition_that_forgot_is_found_by_its_end_offsets_and_gets_its_window_again(settings, pg_dsn) -> None:
    names = Topics(settings.topic_prefix)
    async with relaying(settings, pg_dsn, check_seconds=3600) as (pool, relay):
        await enqueue(pool, 12)
        await drain_all(relay)
        assert await relay.check_broker() == 0, "nothing is replayed while the broker holds everything"
        partitions = await pool.fetchval("SELECT count(DISTINCT p) FROM outbox, unnest(kafka_partitions) AS p")
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


async def test_an_acknowledgement_at_or_below_an_earlier_one_replays_the_partition(settings, pg_dsn) -> None:
    names = Topics(settings.topic_prefix)
    # No periodic check after the first: only the acknowledgements can tell.
    async with relaying(settings, pg_dsn, check_seconds=3600) as (pool, relay):
        await enqueue(pool, 30)
        await drain_all(relay)
        await recreate(settings.kafka_bootstrap, names.policies, settings.topic_prefix)
        await enqueue(pool, 30, start=30)
        assert await relay.relay_once() == 30
        assert relay.replayed > 0 and await pending(pool) == relay.replayed
        await drain_all(relay)
        on_topic = await drain(settings.kafka_bootstrap, names.policies, 60)
        assert len({wire.decode(PolicyBundlePublished, r.value, r.headers).event_id for r in on_topic}) == 60


async def test_a_relay_replays_a_forgetful_partition_whose_watermark_another_relay_moved(settings, pg_dsn) -> None:
    """Two relays on one outbox. A publishes, then B (the stored watermark is now B's, above
    what A remembers); the broker forgets; A's next batch is acknowledged at or below what it
    remembers. The replay compared the stored watermark with A's memory for equality, did
    nothing, and the next check saw a partition already past the watermark: the first two
    records were never sent again."""
    names = Topics(settings.topic_prefix)

    async def one_key(pool: asyncpg.Pool, numbers: range) -> None:
        async with pool.acquire() as conn, conn.transaction():
            for n in numbers:
                await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(_announced(n), key="one-partition"))

    async with relaying(settings, pg_dsn, check_seconds=3600) as (pool, a):
        b = OutboxRelay(pool=pool, publisher=Publisher(settings.kafka_bootstrap), topics=names, check_seconds=3600)
        await b.publisher.start()
        try:
            await one_key(pool, range(0, 1))
            assert await a.relay_once() == 1
            await one_key(pool, range(1, 2))
            assert await b.relay_once() == 1
            await recreate(settings.kafka_bootstrap, names.policies, settings.topic_prefix)
            await one_key(pool, range(2, 7))
            assert await a.relay_once() == 5
            assert a.replayed == 2
            await drain_all(a)
        finally:
            await b.publisher.stop()
            await b.close()
        on_topic = await drain(settings.kafka_bootstrap, names.policies, 7)
        assert sorted(int(wire.decode(PolicyBundlePublished, r.value, r.headers).git_sha, 16) for r in on_topic) == list(range(7))


async def test_a_backlog_larger_than_a_batch_goes_out_whole_in_order_per_key(settings, pg_dsn) -> None:
    """BUDGETGATE_OUTBOX_BATCH rows per transaction: a backlog of several batches is published
    batch by batch, every row once, each key's rows in the order they were written."""
    async with relaying(settings, pg_dsn, batch=7) as (pool, relay):
        async with pool.acquire() as conn, conn.transaction():
            for n in range(30):  # three keys, ten rows each, interleaved
                await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(_announced(n), key=f"k{n % 3}"))
        published = [await relay.relay_once() for _ in range(6)]
        assert published == [7, 7, 7, 7, 2, 0] and await pending(pool) == 0
        found = await drain(settings.kafka_bootstrap, Topics(settings.topic_prefix).policies, expected=30)
        by_key: dict[bytes, list[int]] = {}
        for record in found:
            sent = PolicyBundlePublished.FromString(record.value)
            by_key.setdefault(record.key, []).append(int(sent.git_sha, 16))
        assert sorted(n for ns in by_key.values() for n in ns) == list(range(30))
        assert by_key == {f"k{k}".encode(): list(range(k, 30, 3)) for k in range(3)}


def bundled(first: int, count: int, *, keys: int) -> outbox.Bundle:
    """`count` announcements (git_sha first..) in one bundle, keyed round robin over `keys` keys."""
    trace = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
    numbers = range(first, first + count)
    return outbox.bundle_messages(topic=topics.POLICIES, messages=[_announced(n) for n in numbers], keys=[f"k{n % keys}" for n in numbers], trace_headers=trace)


async def test_a_bundle_goes_out_record_by_record_in_order_among_single_rows(settings, pg_dsn) -> None:
    """Three single rows, a bundle of ten, five single rows; batches of seven records: the first
    claim stops before the bundle (it would pass seven), the second takes the bundle alone
    (a first row goes whatever it carries); both say rows are left, so the relay does not wait
    between them. Every record arrives once with the headers it was encoded with, each key's
    records in the order they were written."""
    async with relaying(settings, pg_dsn, batch=7) as (pool, relay):
        bundle = bundled(3, 10, keys=3)
        async with pool.acquire() as conn, conn.transaction():
            for n in range(3):
                await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(_announced(n), key=f"k{n % 3}"))
            await outbox.enqueue_bundle(conn, bundle)
            await outbox.enqueue_bundle(conn, outbox.bundle_messages(topic=topics.POLICIES, messages=[], keys=[], trace_headers=[]))  # nothing to write
            for n in range(13, 18):
                await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(_announced(n), key=f"k{n % 3}"))
        assert await pool.fetchval("SELECT count(*) FROM outbox") == 9
        published, backlog = [], []
        for _ in range(4):
            published.append(await relay.relay_once())
            backlog.append(relay.backlog)  # rows left behind: the relay claims again at once
        assert published == [3, 10, 5, 0] and await pending(pool) == 0
        assert backlog == [True, True, False, False]
        found = await drain(settings.kafka_bootstrap, Topics(settings.topic_prefix).policies, expected=18)
        by_key: dict[bytes, list[int]] = {}
        for record in found:
            sent = wire.decode(PolicyBundlePublished, record.value, record.headers)
            by_key.setdefault(record.key, []).append(int(sent.git_sha, 16))
            if 3 <= int(sent.git_sha, 16) < 13:
                assert dict(record.headers)["traceparent"] == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                assert dict(record.headers)[wire.EVENT_ID].decode() == bundle.event_ids[int(sent.git_sha, 16) - 3] == sent.event_id
        assert by_key == {f"k{k}".encode(): list(range(k, 18, 3)) for k in range(3)}


async def test_a_bundle_comes_back_whole_when_a_partition_it_went_to_forgot(settings, pg_dsn) -> None:
    names = Topics(settings.topic_prefix)
    async with relaying(settings, pg_dsn, check_seconds=3600) as (pool, relay):
        bundle = bundled(0, 12, keys=6)
        async with pool.acquire() as conn, conn.transaction():
            await outbox.enqueue_bundle(conn, bundle)
        assert await relay.relay_once() == 12
        partitions = await pool.fetchval("SELECT kafka_partitions FROM outbox")
        assert len(partitions) > 1 and partitions == sorted(set(partitions))
        await recreate(settings.kafka_bootstrap, names.policies, settings.topic_prefix)

        assert await relay.check_broker() == 1, "the one row, whatever partition found it first"
        assert await pending(pool) == 1
        assert await relay.relay_once() == 12
        on_topic = await drain(settings.kafka_bootstrap, names.policies, 12)
        assert sorted(wire.decode(PolicyBundlePublished, r.value, r.headers).event_id for r in on_topic) == sorted(bundle.event_ids)


def _announced(n: int) -> PolicyBundlePublished:
    message = PolicyBundlePublished(event_id=str(uuid.uuid4()), git_sha=f"{n:040x}")
    message.event_time.FromDatetime(datetime.now(UTC))
    return message
