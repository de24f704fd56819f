"""The relay's claim on real Postgres, over any mix of single rows and bundles: each claim takes
the next pending rows in id order while they carry at most `batch` records (a first row that
carries more goes alone), so every record is claimed once, in the order it was written, and no
claim is larger than it must be. A property test (hypothesis) against the plain rule."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import asyncpg
from aiokafka import TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging import outbox
from budgetgate.contracts import topics, wire
from budgetgate.ledger.migrations import migrate, migration_files
from budgetgate.ledger.queries import owned_by
from budgetgate.contracts.topics import Topics
from budgetgate.v1.policies_pb2 import PolicyBundlePublished
from tests.support.databases import drop_database, empty_database
from tests.support.pg_sessions import in_pg_sleep
from tests.support.waiting import wait_for

sql = owned_by("budgetgate.messaging")  # its own queries, then the shared ledger's


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 12), max_size=25), batch=st.integers(1, 15))
def test_claims_take_rows_in_order_up_to_the_batch_and_every_record_once(pg_dsn: str, sizes: list[int], batch: int) -> None:
    asyncio.run(_claim_all(pg_dsn, sizes, batch))


async def _claim_all(dsn: str, sizes: list[int], batch: int) -> None:
    """`sizes`: the records of each row written, 1 a single row, more a bundle."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DELETE FROM outbox")
        written: list[list[str]] = []  # per row, the event ids of its records
        async with conn.transaction():
            for size in sizes:
                messages = [_message() for _ in range(size)]
                if size == 1:
                    await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(messages[0], key="k0"))
                else:
                    bundle = outbox.bundle_messages(topic=topics.POLICIES, messages=messages, keys=[f"k{n % 3}" for n in range(size)], trace_headers=[])
                    await outbox.enqueue_bundle(conn, bundle)
                written.append([m.event_id for m in messages])
        claimed: list[list[str]] = []
        while True:
            async with conn.transaction():
                rows = await conn.fetch(sql("claim_outbox"), batch)
                if not rows:
                    break
                carried = [_event_ids(row) for row in rows]
                start = len(claimed)
                # The plain rule: the next rows, as many as fit in `batch` records, at least one.
                expected, total = [], 0
                for row in written[start:]:
                    if expected and total + len(row) > batch:
                        break
                    expected.append(row)
                    total += len(row)
                assert carried == expected
                claimed.extend(carried)
                await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY($1::bigint[])", [row["id"] for row in rows])
        assert claimed == written
    finally:
        await conn.close()


async def test_a_claim_never_takes_rows_another_relay_published_meanwhile(pg_dsn: str) -> None:
    """Relay B's claim reads the pending rows from its snapshot while relay A holds them; A
    publishes them and commits before B gets to lock them. B must then skip them: it used to lock
    them all the same (only the join was checked again) and send every record a second time. The
    window is made wide for the test by a pause in B's claim before it locks anything."""
    name, dsn = await empty_database(pg_dsn, prefix="claim")
    try:
        conn_a, conn_b, watcher = await asyncpg.connect(dsn), await asyncpg.connect(dsn), await asyncpg.connect(dsn)
        await migrate(conn_a)
        claim = sql("claim_outbox")
        paused = claim.replace("FROM (SELECT id, records FROM outbox", "FROM (SELECT pg_sleep(0.5)) AS pause, (SELECT id, records FROM outbox")
        assert paused != claim, "the pause must be in B's claim"
        async with conn_a.transaction():
            for _ in range(3):
                await outbox.enqueue(conn_a, topic=topics.POLICIES, record=wire.encode(_message(), key="k"))
        try:
            async with conn_a.transaction():
                assert len(await conn_a.fetch(claim, 10)) == 3
                claiming = asyncio.ensure_future(conn_b.fetch(paused, 10))  # B's snapshot: three pending rows
                await wait_for(lambda: in_pg_sleep(watcher, conn_b.get_server_pid()), timeout=30, what="B's claim in its pause")
                await conn_a.execute("UPDATE outbox SET published_at = now() WHERE published_at IS NULL")
            assert await claiming == []
        finally:
            for conn in (conn_a, conn_b, watcher):
                await conn.close()
    finally:
        await drop_database(pg_dsn, name)


def _event_ids(row: asyncpg.Record) -> list[str]:
    if row["payloads"] is None:
        return [wire.decode(PolicyBundlePublished, row["payload"], outbox._unpack_headers(row["headers"])).event_id]  # noqa: SLF001
    return list(row["event_ids"])


def _message() -> PolicyBundlePublished:
    message = PolicyBundlePublished(event_id=str(uuid.uuid4()), git_sha="0" * 40)
    message.event_time.FromDatetime(datetime.now(UTC))
    return message


async def test_upgrading_to_bundles_keeps_the_rows_and_the_partitions_they_went_to(pg_dsn: str) -> None:
    """A database at 0017 with pending and published outbox rows: after 0018 each is a one-record
    row, a published one with its partition in kafka_partitions, and the claim takes the pending one."""
    name, dsn = await empty_database(pg_dsn)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE TABLE schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
            for migration, text in migration_files():
                if migration >= "0018":
                    break
                await conn.execute(text)
                await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", migration)
            await conn.execute(
                """INSERT INTO outbox (topic, key, payload, headers, published_at, kafka_partition)
                   VALUES ('t', 'a', 'one', '[]', now(), 2), ('t', 'b', 'two', '[]', NULL, NULL)"""
            )
            assert await migrate(conn) == [m for m, _ in migration_files() if m >= "0018"]
            rows = await conn.fetch("SELECT key, payload, records, kafka_partitions, payloads FROM outbox ORDER BY id")
            assert [tuple(r) for r in rows] == [("a", b"one", 1, [2], None), ("b", b"two", 1, None, None)]
            async with conn.transaction():
                assert [r["key"] for r in await conn.fetch(sql("claim_outbox"), 10)] == ["b"]
        finally:
            await conn.close()
    finally:
        await drop_database(pg_dsn, name)


async def test_a_relay_pass_commits_without_its_flush_unless_it_replays_what_a_broker_lost(pg_dsn: str) -> None:
    """What a pass records is only that rows went out: losing it in a crash sends them again. Making
    rows pending again for a broker that lost them must not be lost, so that commit flushes (as
    the server is configured to: on, here)."""
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    relay = outbox.OutboxRelay(pool=pool, publisher=Publisher("127.0.0.1:9"), topics=Topics(""))
    try:
        async with pool.acquire() as conn:
            await conn.execute("DELETE FROM outbox")
            async with conn.transaction():
                assert await outbox.claim(conn, 10) == []
                assert await conn.fetchval("SHOW synchronous_commit") == "on"  # nothing claimed, nothing changed
            await outbox.enqueue(conn, topic=topics.POLICIES, record=wire.encode(_message(), key="k0"))
            async with conn.transaction():
                assert len(await outbox.claim(conn, 10)) == 1
                assert await conn.fetchval("SHOW synchronous_commit") == "off"
                await relay._replay(conn, {TopicPartition(topics.POLICIES, 0): 0}, why="ends at offset")  # noqa: SLF001
                assert await conn.fetchval("SHOW synchronous_commit") == "on"
            assert await conn.fetchval("SHOW synchronous_commit") == "on"  # SET LOCAL: that transaction's only
    finally:
        await pool.close()
