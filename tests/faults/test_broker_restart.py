"""The Kafka broker killed mid-stream and restarted empty (Tansu keeps topics in memory, as a
cluster restored from an older state would miss its newest records): every decision admission
answered is on the decisions topic again afterwards and reaches the evidence emitter, because
the outbox keeps published rows for a replay window and resends what the broker forgot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import create_conn
from aiokafka.protocol.admin import CreateTopicsRequest

from budgetgate.chaos.observation import decisions_on_topic, evidence_trail
from budgetgate.chaos.tcp_proxy import TcpProxy
from budgetgate.contracts.topics import Topics
from budgetgate.devstack.kafka import TansuBroker

from budgetgate.messaging.subscriber import committed, offsets_lost
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.decisions_pb2 import Decision
from budgetgate.contracts.wire import encode
from budgetgate.runtime.kafka_access import start_whole
from tests.support.admission import apply_policies, budget_yaml
from tests.support.marquez import EmitterServer, decision, emitter_settings, http_client
from tests.support.marquez import marquez  # noqa: F401 - pytest fixtures
from tests.support.servers import free_port
from tests.support.waiting import wait_for

DECISIONS = 120
KILL_AFTER = 30  # published (acknowledged) decisions before the kill


async def published(dsn: str, *, at_least: int) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        count = await conn.fetchval("SELECT COALESCE(sum(records), 0) FROM outbox WHERE topic = 'budget.decisions.v1' AND published_at IS NOT NULL")
        return count >= at_least
    finally:
        await conn.close()


async def decision_ids(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {str(r["decision_id"]) for r in await conn.fetch("SELECT decision_id FROM decisions")}
    finally:
        await conn.close()


async def test_broker_restarted_empty_gets_every_answered_decision_again(admission_factory, killable_kafka, settings, pg_dsn, marquez) -> None:  # noqa: F811
    bootstrap = killable_kafka.url
    await ensure_topics(bootstrap, prefix=settings.topic_prefix)
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("k", limit="gpu_hours: 1000000")}, sha="f" * 40)
    server = await admission_factory(kafka_bootstrap=bootstrap)
    await server.wait_ready()
    emitter = await EmitterServer(emitter_settings(settings, kafka_bootstrap=bootstrap), http_client(marquez.url)).start()
    try:

        async def submit(first: int, last: int) -> None:
            for i in range(first, last):
                answer = await server.submit(run_id=f"b{i}", labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)
                assert answer.status_code == 200, answer.text

        # The first part goes out and is acknowledged before the kill; the rest is answered
        # while the broker is down or just back, so the kill always lands mid-stream.
        await submit(0, KILL_AFTER)
        await wait_for(lambda: published(pg_dsn, at_least=KILL_AFTER), timeout=60, what="the first decisions acknowledged")
        killable_kafka.stop()
        await submit(KILL_AFTER, DECISIONS // 2)
        killable_kafka.start()  # empty: the acknowledged decisions are gone from it
        await submit(DECISIONS // 2, DECISIONS)

        answered = await decision_ids(pg_dsn)
        assert len(answered) == DECISIONS

        async def all_on_topic() -> bool:
            try:
                # Until a poll brings nothing: Tansu reports a partition's end offset too low to read up to.
                return answered <= set(await decisions_on_topic(bootstrap, prefix=settings.topic_prefix, quiet_polls=1))
            except Exception:  # noqa: BLE001 - the broker may still be settling; look again
                return False

        await wait_for(all_on_topic, timeout=120, what="every answered decision on the decisions topic again")
        assert server.rt.relay.replayed >= KILL_AFTER, "the acknowledged decisions the broker lost were sent again"

        try:
            await wait_for(lambda: answered <= delivered_ids(marquez), timeout=120, what="every decision delivered as evidence")
        except AssertionError as exc:
            missing = sorted(answered - delivered_ids(marquez))[:10]
            placed = await decisions_on_topic(bootstrap, prefix=settings.topic_prefix)
            trail = await evidence_trail(pg_dsn, bootstrap, missing, placed, prefix=settings.topic_prefix)
            reading = emitter.assigned()
            raise AssertionError(f"{exc}: {len(answered - delivered_ids(marquez))} missing, the first: {trail}; the emitter reads {reading}") from None
    finally:
        await emitter.stop()
    assert delivered_ids(marquez) - answered == set(), "no evidence of a decision that was never answered"


class TansuBehindProxy(TansuBroker):
    """A broker that tells its clients to reach it through `advertised` (a proxy's port): the
    test can then cut the clients off while it talks to the broker itself."""

    def __init__(self, *, log: Path, advertised: int) -> None:
        self.listening = free_port()
        super().__init__(log=log, port=self.listening)
        self.advertised = advertised

    def command(self) -> list[str]:
        return [*super().command()[:4], "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised}", "--storage-engine", "memory://tansu/"]


async def test_seed_20261128_a_partition_the_restarted_broker_made_anew_is_read_too(settings, marquez, tmp_path) -> None:  # noqa: F811
    """A broker that lost its state makes a topic anew when a client asks for it, with its own
    partition count (Tansu: 4 partitions, where budgetgate creates 3). An emitter that finds the
    topics there when it reconnects sees no error and keeps its view of 3 partitions, so no
    member of its group reads the fourth until that view is renewed (kafka_metadata_max_age_ms;
    aiokafka's default is 5 minutes)."""
    proxy = await TcpProxy("emitter->kafka", upstream=("127.0.0.1", 0)).start()
    broker = TansuBehindProxy(log=tmp_path / "kafka.log", advertised=proxy.port)
    broker.start()
    proxy.redirect(("127.0.0.1", broker.listening))
    bootstrap = f"127.0.0.1:{proxy.port}"
    topics = Topics(settings.topic_prefix)
    emitter = None
    try:
        await create_topics(broker, topics, partitions=3)
        emitter_config = emitter_settings(settings, kafka_bootstrap=bootstrap, kafka_metadata_max_age_ms=METADATA_MAX_AGE_MS)
        emitter = await EmitterServer(emitter_config, http_client(marquez.url)).start()
        before = decision("before-the-kill")
        await publish_to(bootstrap, topics.decisions, before, partition=0)
        await wait_for(lambda: before.decision_id in delivered_ids(marquez), timeout=60, what="a decision delivered before the kill")
        proxy.cut()
        broker.kill()
        broker.start()  # empty
        await create_topics(broker, topics, partitions=4)  # before the emitter can reach it
        proxy.heal()
        after = decision("on-the-new-partition")
        await publish_to(bootstrap, topics.decisions, after, partition=3)
        await wait_for(lambda: after.decision_id in delivered_ids(marquez), timeout=60, what="the decision on the partition the broker added delivered")
    finally:
        if emitter is not None:
            await emitter.stop()
        broker.kill()
        await proxy.close()


METADATA_MAX_AGE_MS = 2_000  # aiokafka's default, 300 000, leaves the fourth unread


async def create_topics(broker: TansuBehindProxy, topics: Topics, *, partitions: int) -> None:
    """Create every topic on `broker` over a connection of its own (its clients are told to go
    through the proxy, which may be cut)."""
    conn = await create_conn("127.0.0.1", broker.listening)
    try:
        wanted = [(name, partitions, 1, [], []) for name in topics.all()]
        answer = await conn.send(CreateTopicsRequest(create_topic_requests=wanted, timeout=10_000, validate_only=False))
        assert all(code == 0 for _, code, *_ in answer.topic_errors), answer
    finally:
        conn.close()


def delivered_ids(marquez: Any) -> set[str]:
    return {e["run"]["facets"]["budget"]["decision_id"] for e in marquez.received()}


async def publish_to(bootstrap: str, topic: str, message: Decision, *, partition: int) -> None:
    """Send `message` to one partition of `topic`."""
    record = encode(message, key=message.run_id)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await start_whole(producer.start())
    try:
        await producer.send_and_wait(topic, value=record.value, key=record.key, headers=record.headers, partition=partition)
    finally:
        await producer.stop()


async def test_a_consumer_whose_broker_lost_the_groups_offsets_reads_its_partitions_again(killable_kafka, topic_prefix) -> None:  # noqa: F811
    """The race behind CI's missing evidence (2026-12-01, twice in three full runs): a consumer
    that committed offset 5, whose broker restarts empty and takes records again (the relay's
    resends, and a decision answered meanwhile at offset 0) before the consumer asks, fetches on
    from its old position 5, within range of the new log: offset 0 is never read. Before its next
    commit it asks the broker what the group committed, finds nothing where it committed 5, and
    reads the partition again from the start; with its offsets intact it commits as before."""
    bootstrap = killable_kafka.url
    topic = f"{topic_prefix}decisions"
    tp = TopicPartition(topic, 0)

    async def produce(values: list[bytes]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await start_whole(producer.start())
        try:
            for value in values:
                await producer.send_and_wait(topic, value=value, partition=0)
        finally:
            await producer.stop()

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1)])
        finally:
            await admin.close()

    await create()
    await produce([b"old-%d" % i for i in range(5)])
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"{topic_prefix}group", enable_auto_commit=False, auto_offset_reset="earliest")
    await start_whole(consumer.start())
    try:
        batch = await consumer.getmany(timeout_ms=10_000)
        assert [r.value for r in batch[tp]] == [b"old-%d" % i for i in range(5)]
        assert not await offsets_lost(consumer, [tp], name="test")  # nothing committed yet: nothing to compare
        await consumer.commit({tp: 5})
        committed(consumer, {tp: 5})
        assert not await offsets_lost(consumer, [tp], name="test")  # the broker holds what was committed
        assert await consumer.position(tp) == 5

        killable_kafka.stop()
        killable_kafka.start()  # empty
        await create()
        await produce([b"new", *(b"old-%d" % i for i in range(5)), b"old-again"])  # offsets 0-6, past the old position

        assert await offsets_lost(consumer, [tp], name="test")
        assert await consumer.position(tp) == 0, "sought back to the start of the new log"
        seen: list[bytes] = []
        for _ in range(20):
            for records in (await consumer.getmany(timeout_ms=1_000)).values():
                seen.extend(r.value for r in records)
            if b"new" in seen:
                break
        assert seen[:1] == [b"new"]
        assert not await offsets_lost(consumer, [tp], name="test"), "forgotten once acted on: the next commit goes ahead"
    finally:
        await consumer.stop()
