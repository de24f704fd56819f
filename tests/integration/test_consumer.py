"""The inbox on real Kafka and Postgres, fed as the services feed it (a FastStream batch subscriber,
budgetgate.messaging.subscriber.apply_acked per poll): effects once, offsets after effects, poison to the
dead-letter topic, outages retried without skipping."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from budgetgate.messaging.publisher import Publisher
from budgetgate.contracts import wire
from budgetgate.messaging.inbox import BatchRoute, Delivery, Inbox, Poison, Route, Turn, locks_taken, prune_forever
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.messaging.subscriber import INBOX_SUBSCRIBER, Pipeline, apply_acked
from budgetgate.contracts.topics import Topics, dlq
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1 import lifecycle_pb2
from tests.support.kafka import drain
from tests.support.waiting import wait_for


def event(run_id: str, event_id: str | None = None) -> lifecycle_pb2.LifecycleEvent:
    stamp = Timestamp()
    stamp.GetCurrentTime()
    return lifecycle_pb2.LifecycleEvent(event_id=event_id or str(uuid.uuid4()), event_time=stamp, run_id=run_id, type=lifecycle_pb2.STARTED)


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_effects_once_poison_to_dlq_outage_retried(settings, pg_dsn, pipelined: bool) -> None:
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

    async with Publisher(settings.kafka_bootstrap) as publisher:
        duplicate = event("twice")
        for message in [event("a"), duplicate, duplicate, event("poison"), event("overflow"), event("flaky"), event("b")]:
            await publisher.send(topics.lifecycle, message, key=message.run_id)
        raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
        await raw.start()
        await raw.send_and_wait(topics.lifecycle, b"\x00not protobuf", headers=[("content-type", b"application/x-protobuf")])
        await raw.stop()

        group = f"g-{uuid.uuid4().hex[:8]}"
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, handle)})
        assert await _consume(settings, inbox, group, 8, pipelined=pipelined) == 8

        rows = sorted(r["run_id"] for r in await pool.fetch("SELECT run_id FROM effects"))
        assert rows == ["a", "b", "flaky", "twice"]
        assert inbox.duplicates == 1 and inbox.dead_lettered == 3 and failures["left"] == 0
        dead = await drain(settings.kafka_bootstrap, dlq(topics.lifecycle), 3)
        reasons = sorted(wire.header(r.headers, "dlq-reason").decode() for r in dead)
        assert len(reasons) == 3 and any("cannot store" in r for r in reasons)
        assert any("poison" in r for r in reasons) and any("protobuf" in r.lower() or "parse" in r.lower() for r in reasons)

        # The group's offsets were committed after the effects: a restart reads nothing again.
        again = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, handle)})
        assert await _consume(settings, again, group, 1, timeout=3, pipelined=pipelined) == 0
    await pool.close()


async def _publish(settings, topic: str, messages: list) -> None:  # type: ignore[no-untyped-def,type-arg]
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await asyncio.gather(*(publisher.send(topic, m, key="one-partition") for m in messages))


async def _consume(  # type: ignore[no-untyped-def]
    settings, inbox: Inbox, group: str, expected: int, *, progress: ConsumerProgress | None = None, timeout: float = 30, pipelined: bool = False, **options
) -> int:
    """Feed `inbox` from its topics in consumer group `group` as the services do (one FastStream
    batch subscriber, `apply_acked` per poll, or a Pipeline when `pipelined`) until `expected`
    records are taken care of or `timeout` seconds passed; the number taken care of."""
    taken = 0
    enough = asyncio.Event()
    broker = KafkaBroker(settings.kafka_bootstrap)
    pipeline = Pipeline(inbox, progress=progress)

    @broker.subscriber(*inbox.routes, group_id=group, **INBOX_SUBSCRIBER, **settings.kafka_group_timing, **options)
    async def apply(message: KafkaMessage) -> None:
        nonlocal taken
        if pipelined:
            await pipeline.apply(message)
            taken += len(message.raw_message)
            if taken >= expected:
                await pipeline.drain()  # the last poll commits in the background
        else:
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


def _batch_route(seen: list[list[str]], *, offsets: bool = False) -> BatchRoute:
    """Writes every message's run id with one statement; refuses 'refused', names 'poison' as
    poison, and lets Postgres refuse 'overflow'. With `offsets`, tracked by offsets, its effect
    idempotent by the message's own identity (its run id, as a sample's id is for metering-ingest)."""
    insert = "INSERT INTO effects VALUES ($1, $2)" + (" ON CONFLICT (run_id) DO NOTHING" if offsets else "")

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> dict[Delivery, str]:
        seen.append([d.message.run_id for d in deliveries])
        for delivery in deliveries:
            if delivery.message.run_id == "poison":
                raise Poison("run id 'poison' is not acceptable", delivery=delivery)
        refused = {d: "refused by the handler" for d in deliveries if d.message.run_id == "refused"}
        kept = [d for d in deliveries if d not in refused]
        if any(d.message.run_id == "overflow" for d in kept):
            await conn.fetchval("SELECT $1::int", 2**40)
        await conn.executemany(insert, [(d.message.run_id, d.message.event_id) for d in kept])
        return refused

    return BatchRoute(lifecycle_pb2.LifecycleEvent, handle, offsets=offsets)


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_batch_with_poison_in_the_middle_commits_the_others_once(settings, pg_dsn, pipelined: bool) -> None:
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
    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: _batch_route(seen)})
        assert await _consume(settings, inbox, group, 9, progress=progress, pipelined=pipelined) == 9
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


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_redelivered_batch_changes_nothing(settings, pg_dsn, pipelined: bool) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, event_id text NOT NULL UNIQUE)")
    await _publish(settings, topics.lifecycle, [event(f"run-{i}") for i in range(20)])
    seen: list[list[str]] = []
    async with Publisher(settings.kafka_bootstrap) as publisher:
        # A second group reads the same records again: the inbox (same name) takes every one as a duplicate.
        for attempt in range(2):
            inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: _batch_route(seen)})
            assert await _consume(settings, inbox, f"g-{attempt}-{uuid.uuid4().hex[:8]}", 20, pipelined=pipelined) == 20
            assert inbox.processed == (20 if attempt == 0 else 0)
            assert inbox.duplicates == (0 if attempt == 0 else 20)
    assert await pool.fetchval("SELECT count(*) FROM effects") == 20
    assert sum(len(batch) for batch in seen) == 20, "a duplicate reached the handler"
    await pool.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_offsets_committed_only_after_the_postgres_commit(settings, pg_dsn, pipelined: bool) -> None:
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

    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: BatchRoute(lifecycle_pb2.LifecycleEvent, handle)})
        polling = asyncio.create_task(_consume(settings, inbox, group, 5, timeout=60, pipelined=pipelined))
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


async def test_pipelined_polls_overlap_and_apply_in_order(settings, pg_dsn) -> None:
    """The next poll is claimed (and prepared) while the one before it is still in its
    transaction, yet every handler sees the effects of every message before it: a counter row
    each message takes under its lock and writes its own position into."""
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE line (id int PRIMARY KEY, last int NOT NULL); INSERT INTO line VALUES (1, -1)")
    await pool.execute("CREATE TABLE effects (position int NOT NULL, seen int NOT NULL)")
    await _publish(settings, topics.lifecycle, [event(str(i)) for i in range(12)])
    log: list[tuple[str, int]] = []

    def prepare(deliveries: Sequence[Delivery]) -> None:
        log.append(("prepared", int(deliveries[0].message.run_id)))

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> None:
        first = int(deliveries[0].message.run_id)
        log.append(("handling", first))
        positions = [int(d.message.run_id) for d in deliveries]
        for position in positions:
            seen = await conn.fetchval("SELECT last FROM line WHERE id = 1 FOR UPDATE")
            await conn.execute("UPDATE line SET last = $1 WHERE id = 1", position)
            await conn.execute("INSERT INTO effects VALUES ($1, $2)", position, seen)
        if 11 not in positions:  # the last poll has none after it
            # The next poll is fetched, claimed and prepared meanwhile, while this transaction is open.
            await wait_for(lambda: any(step == "prepared" and at > first for step, at in log), timeout=10, what=f"the poll after {first} prepared")
        log.append(("handled", first))

    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: BatchRoute(lifecycle_pb2.LifecycleEvent, handle, prepare)})
        group = f"g-{uuid.uuid4().hex[:8]}"
        assert await _consume(settings, inbox, group, 12, pipelined=True, max_records=3) == 12
    effects = [(r["position"], r["seen"]) for r in await pool.fetch("SELECT position, seen FROM effects ORDER BY position")]
    assert effects == [(i, i - 1) for i in range(12)], "a message was applied before one ahead of it"
    assert await _committed(settings.kafka_bootstrap, group, topics.lifecycle) == 12
    # Overlap: a poll was prepared before the handler of the poll ahead of it had returned.
    overlapped = [i for i, (step, _) in enumerate(log) if step == "prepared" and any(s == "handling" for s, _ in log[:i]) and log[i - 1][0] != "handled"]
    assert overlapped, f"no poll overlapped the one before it: {log}"
    # And no handler started before the one ahead of it returned.
    handlers = [(step, first) for step, first in log if step != "prepared"]
    assert handlers == [(step, first) for first in sorted({f for s, f in handlers}) for step in ("handling", "handled")]
    await pool.close()


class _Crash(BaseException):
    """What no inbox retries (not an Exception): the poll fails."""


async def test_a_failed_pipelined_poll_is_read_again_and_nothing_after_it_is_committed_first(settings, pg_dsn) -> None:
    """A poll whose transaction fails (not an outage, which the inbox retries in place) rewinds
    its partition, and the poll after it, already running, is rolled back with it: every
    message is applied once, and the committed offset never passes a message not applied."""
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL UNIQUE)")
    await _publish(settings, topics.lifecycle, [event(str(i)) for i in range(12)])
    crashes = {"left": 1}
    group = f"g-{uuid.uuid4().hex[:8]}"
    committed_while_crashed: list[int | None] = []

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> None:
        await conn.executemany("INSERT INTO effects VALUES ($1)", [(d.message.run_id,) for d in deliveries])
        if any(d.message.run_id == "4" for d in deliveries) and crashes["left"]:
            crashes["left"] -= 1
            committed_while_crashed.append(await _committed(settings.kafka_bootstrap, group, topics.lifecycle))
            raise _Crash("the poll fails")

    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: BatchRoute(lifecycle_pb2.LifecycleEvent, handle)})
        pipeline = Pipeline(inbox)
        consumer = AIOKafkaConsumer(
            topics.lifecycle,
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **settings.kafka_group_timing,
        )
        await consumer.start()
        failures = 0
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while asyncio.get_running_loop().time() < deadline:
                polled = await consumer.getmany(timeout_ms=200, max_records=3)
                records = tuple(r for batch in polled.values() for r in batch)
                if records:
                    try:
                        await pipeline.apply(_Polled(records, consumer))
                    except RuntimeError as exc:  # what the handler of the poll after the failed one raises
                        assert isinstance(exc.__cause__, _Crash)
                        failures += 1
                        # A poll fetched before the rewind (as a prefetch could be) is dropped,
                        # and the partition sought back again: nothing of it is applied now.
                        tp = TopicPartition(topics.lifecycle, 0)
                        rewound_to = await consumer.position(tp)
                        before = await pool.fetchval("SELECT count(*) FROM effects")
                        await pipeline.apply(_Polled(records, consumer))
                        assert await consumer.position(tp) == rewound_to and records[0].offset > rewound_to
                        assert await pool.fetchval("SELECT count(*) FROM effects") == before
                elif await _committed(settings.kafka_bootstrap, group, topics.lifecycle) == 12:
                    break
            await pipeline.drain()
        finally:
            await consumer.stop()
    assert crashes["left"] == 0 and failures == 1
    assert committed_while_crashed[0] is None or committed_while_crashed[0] <= 4
    assert sorted(int(r["run_id"]) for r in await pool.fetch("SELECT run_id FROM effects")) == list(range(12))
    assert await _committed(settings.kafka_bootstrap, group, topics.lifecycle) == 12
    await pool.close()


class _Polled:
    """One poll as a FastStream batch message gives it to a handler (records and consumer)."""

    def __init__(self, records: tuple, consumer: AIOKafkaConsumer) -> None:  # type: ignore[type-arg]
        self.raw_message = records
        self.consumer = consumer


def _record(offset: int, message: lifecycle_pb2.LifecycleEvent, topic: str) -> ConsumerRecord:
    encoded = wire.encode(message, key=message.run_id)
    return ConsumerRecord(topic, 0, offset, 0, 0, encoded.key, encoded.value, None, len(encoded.key or b""), len(encoded.value), encoded.headers)


@pytest.mark.parametrize("failure", ["outage", "poison"])
async def test_overlapping_batches_sharing_an_event_id_finish_when_the_first_is_applied_again(settings, pg_dsn, failure: str) -> None:
    """Batch N and batch N+1, in flight together, both carry event X (a producer's retry). N's
    handler fails once after N claimed X (an outage, or poison that rolls N back to apply it
    without the culprit); N+1 must not hold X against N's second claim while it waits for N's
    handlers: both finish, and X is applied once, by N."""
    topic = Topics(settings.topic_prefix).lifecycle
    pool = await asyncpg.create_pool(pg_dsn, min_size=2, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, event_id text NOT NULL UNIQUE)")
    calls = {"first": 0}
    shared = event("x")

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> None:
        names = [d.message.run_id for d in deliveries]
        if "first" in names and calls["first"] == 0:
            calls["first"] += 1
            await asyncio.wait_for(second.claimed.wait(), timeout=10)  # N+1 claims meanwhile
            if failure == "outage":
                raise ConnectionResetError("Postgres went away")
            raise Poison("the first message is poison", delivery=deliveries[names.index("first")])
        await conn.executemany("INSERT INTO effects VALUES ($1, $2)", [(d.message.run_id, d.message.event_id) for d in deliveries])

    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topic: BatchRoute(lifecycle_pb2.LifecycleEvent, handle)}, max_backoff=0.2)
        first = Turn()
        second = Turn(after=first)
        applying = [
            asyncio.ensure_future(inbox.apply([_record(0, event("first"), topic), _record(1, shared, topic)], turn=first)),
            asyncio.ensure_future(inbox.apply([_record(2, shared, topic), _record(3, event("second"), topic)], turn=second)),
        ]
        done, pending = await asyncio.wait(applying, timeout=20)
        for stuck in pending:
            stuck.cancel()
        await asyncio.gather(*applying, return_exceptions=True)
        assert not pending, "the two batches deadlocked"
    effects = sorted(r["run_id"] for r in await pool.fetch("SELECT run_id FROM effects"))
    assert effects == (["first", "second", "x"] if failure == "outage" else ["second", "x"])
    assert [a.result().duplicates for a in applying] == [0, 1]
    await pool.close()


async def test_a_handler_that_says_it_holds_its_locks_lets_the_next_batch_start_in_its_wake(settings, pg_dsn) -> None:
    """Batch N's handler takes its lock, says `locks_taken`, then goes on with work that takes
    none. Batch N+1's handler starts meanwhile (Postgres works on it while N finishes), and still
    waits on N's lock in Postgres until N commits: it sees N's effect once it has the lock."""
    topic = Topics(settings.topic_prefix).lifecycle
    pool = await asyncpg.create_pool(pg_dsn, min_size=2, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL, saw_first boolean NOT NULL)")
    steps: list[str] = []
    first_may_finish = asyncio.Event()

    async def handle(conn: asyncpg.Connection, deliveries: Sequence[Delivery]) -> None:
        name = deliveries[0].message.run_id
        steps.append(f"{name} starts")
        await conn.execute("SELECT pg_advisory_xact_lock(4242)")  # both batches touch one run
        saw_first = bool(await conn.fetchval("SELECT count(*) FROM effects WHERE run_id = 'first'"))
        await conn.execute("INSERT INTO effects VALUES ($1, $2)", name, saw_first)
        if name == "first":
            locks_taken()
            await asyncio.wait_for(first_may_finish.wait(), timeout=10)  # the outbox work, say
            steps.append("first returns")

    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topic: BatchRoute(lifecycle_pb2.LifecycleEvent, handle)}, max_backoff=0.2)
        first = Turn()
        second = Turn(after=first)
        applying = [
            asyncio.ensure_future(inbox.apply([_record(0, event("first"), topic)], turn=first)),
            asyncio.ensure_future(inbox.apply([_record(1, event("second"), topic)], turn=second)),
        ]
        await wait_for(lambda: "second starts" in steps, timeout=10, what="the next batch's handler to start before the first's returns")
        assert steps == ["first starts", "second starts"]
        first_may_finish.set()
        await asyncio.wait_for(asyncio.gather(*applying), timeout=20)
    rows = {r["run_id"]: r["saw_first"] for r in await pool.fetch("SELECT run_id, saw_first FROM effects")}
    assert rows == {"first": False, "second": True}, "the next batch ran under the lock before the first batch committed"
    await pool.close()


async def _offsets(pool: asyncpg.Pool, topic: str) -> list[tuple[int, int, int, int]]:
    rows = await pool.fetch(
        "SELECT kafka_partition, first_offset, last_offset, records FROM consumer_offsets WHERE consumer = 'test' AND topic = $1 ORDER BY first_offset", topic
    )
    return [tuple(r) for r in rows]  # type: ignore[misc]


@pytest.mark.parametrize("pipelined", [False, True], ids=["one-by-one", "pipelined"])
async def test_a_route_tracked_by_offsets_keeps_no_inbox_row_and_records_each_polls_offsets(settings, pg_dsn, pipelined: bool) -> None:
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL UNIQUE, event_id text NOT NULL)")
    twice = event("twice")
    names = ["a", "poison", "b", "refused", "c", "d"]
    await _publish(settings, topics.lifecycle, [event(n) for n in names[:3]] + [twice, twice] + [event(n) for n in names[3:]])
    seen: list[list[str]] = []
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with Publisher(settings.kafka_bootstrap) as publisher:
        inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: _batch_route(seen, offsets=True)})
        assert await _consume(settings, inbox, group, 8, pipelined=pipelined, max_records=3) == 8
        reasons = sorted(wire.header(r.headers, wire.DLQ_REASON).decode() for r in await drain(settings.kafka_bootstrap, dlq(topics.lifecycle), 2))
    assert sorted(r["run_id"] for r in await pool.fetch("SELECT run_id FROM effects")) == ["a", "b", "c", "d", "twice"]
    assert len(reasons) == 2 and "refused by the handler" in reasons and any("poison" in r for r in reasons)
    assert inbox.dead_lettered == 2 and inbox.processed == 5
    # No inbox row per message: each poll recorded the offsets it applied, in its transaction;
    # together they cover every record once (poison, refusals and duplicates included).
    assert await pool.fetchval("SELECT count(*) FROM inbox WHERE consumer = 'test'") == 0
    polls = await _offsets(pool, topics.lifecycle)
    assert len(polls) >= 3 and all(p == 0 and last - first < n <= 3 for p, first, last, n in polls), polls
    covered = sorted(o for _, first, last, _ in polls for o in range(first, last + 1))
    assert covered == list(range(8)) and sum(n for *_, n in polls) == 8
    assert await _committed(settings.kafka_bootstrap, group, topics.lifecycle) == 8
    await pool.close()


async def test_a_poll_of_a_route_tracked_by_offsets_delivered_again_reaches_the_handler_and_changes_nothing(settings, pg_dsn) -> None:
    """Nothing is skipped by offset (a broker that lost its log numbers new records from 0 again):
    a poll read again, as after a crash before its offsets reached Kafka, is given to the handler
    again, whose effects are idempotent by the messages' own identity."""
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=1)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    await pool.execute("CREATE TABLE effects (run_id text NOT NULL UNIQUE, event_id text NOT NULL)")
    await _publish(settings, topics.lifecycle, [event(f"run-{i}") for i in range(10)])
    seen: list[list[str]] = []
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for attempt in range(2):  # a second group reads the same records again
            inbox = Inbox(name="test", pool=pool, publisher=publisher, routes={topics.lifecycle: _batch_route(seen, offsets=True)})
            assert await _consume(settings, inbox, f"g-{attempt}-{uuid.uuid4().hex[:8]}", 10) == 10
            assert (inbox.processed, inbox.duplicates) == (10, 0)
    assert await pool.fetchval("SELECT count(*) FROM effects") == 10
    assert sum(len(batch) for batch in seen) == 20
    assert sum(n for *_, n in await _offsets(pool, topics.lifecycle)) == 20
    await pool.close()


async def test_pruning_forgets_old_inbox_rows_and_offsets_but_each_partitions_latest_and_other_consumers_rows(pg_dsn) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    rows = [
        ("test", "t", 0, 0, 9, 10, "-3 hours"),
        ("test", "t", 0, 10, 19, 10, "-2 hours"),
        ("test", "t", 0, 20, 29, 10, "-90 minutes"),  # partition 0's latest: kept, however old
        ("test", "t", 1, 0, 4, 5, "-3 hours"),
        ("test", "t", 1, 5, 9, 5, "-1 minute"),  # recent: kept
        ("test", "t", 1, 10, 14, 5, "0 minutes"),
        ("other", "t", 0, 0, 9, 10, "-3 hours"),  # another consumer's: kept
        ("other", "t", 0, 10, 19, 10, "0 minutes"),
    ]
    await pool.executemany(
        "INSERT INTO consumer_offsets (consumer, topic, kafka_partition, first_offset, last_offset, records, applied_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, now() + $7::text::interval)",
        rows,
    )
    inbox_rows = [("test", f"old-{i}", "-2 hours") for i in range(7)] + [("test", "new", "0 minutes"), ("other", "old", "-2 hours")]
    await pool.executemany("INSERT INTO inbox (consumer, event_id, topic, processed_at) VALUES ($1, $2, 't', now() + $3::text::interval)", inbox_rows)
    inbox = Inbox(name="test", pool=pool, publisher=None, routes={})  # type: ignore[arg-type]
    before = await pool.fetchval("SELECT now() - interval '1 hour'")
    assert await inbox.prune(before, slice_rows=2) == (7, 3)  # slices of 2, repeated until done
    left = await pool.fetch("SELECT consumer, kafka_partition, first_offset FROM consumer_offsets ORDER BY 1, 2, 3")
    assert [tuple(r) for r in left] == [("other", 0, 0), ("other", 0, 10), ("test", 0, 20), ("test", 1, 5), ("test", 1, 10)]
    assert sorted(tuple(r) for r in await pool.fetch("SELECT consumer, event_id FROM inbox")) == [("other", "old"), ("test", "new")]
    assert await inbox.prune(before) == (0, 0)
    await pool.close()


async def test_the_services_pruning_loop_forgets_past_the_retention_and_outlives_a_failure(pg_dsn) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    await pool.execute("INSERT INTO inbox (consumer, event_id, topic, processed_at) VALUES ('test', 'old', 't', now() - interval '3 hours')")
    failures = {"left": 1}
    inbox = Inbox(name="test", pool=pool, publisher=None, routes={})  # type: ignore[arg-type]
    prune = inbox.prune

    async def flaky(before: datetime) -> tuple[int, int]:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("Postgres went away")
        return await prune(before)

    inbox.prune = flaky  # type: ignore[method-assign]
    loop = asyncio.create_task(prune_forever(inbox, keep=timedelta(hours=1), every=0.05))
    try:
        await wait_for(lambda: _inbox_empty(pool), timeout=10, what="the old inbox row pruned")
        assert failures["left"] == 0 and not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await pool.close()


async def _inbox_empty(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM inbox WHERE consumer = 'test'") == 0
