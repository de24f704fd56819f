"""The Kafka broker killed mid-stream and restarted empty (Tansu keeps topics in memory, as a
cluster restored from an older state would miss its newest records): every decision admission
answered is on the decisions topic again afterwards and reaches the evidence emitter, because
the outbox keeps published rows for a replay window and resends what the broker forgot."""

from __future__ import annotations

import asyncio

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from budgetgate.contracts.topics import Topics

from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.v1.decisions_pb2 import Decision
from budgetgate.contracts.wire import decode
from tests.support.admission import apply_policies, budget_yaml
from tests.support.marquez import EmitterServer, emitter_settings, http_client
from tests.support.marquez import marquez  # noqa: F401 - pytest fixtures
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


async def on_topic(bootstrap: str, topic: str) -> set[str]:
    """Event ids of every decision the topic holds now, read from the start of each partition."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        await asyncio.wait_for(consumer.topics(), timeout=10)  # fresh metadata
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not tps:
            return set()
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ids: set[str] = set()
        # Until a poll brings nothing: Tansu reports a partition's end offset too low to read up to.
        while batches := await consumer.getmany(*tps, timeout_ms=1000):
            for records in batches.values():
                ids.update(decode(Decision, r.value, r.headers).event_id for r in records)
        return ids
    finally:
        await consumer.stop()


async def test_broker_restarted_empty_gets_every_answered_decision_again(admission_factory, killable_kafka, settings, pg_dsn, marquez) -> None:  # noqa: F811
    bootstrap = killable_kafka.url
    topics = Topics(settings.topic_prefix)
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
                return answered <= await on_topic(bootstrap, topics.decisions)
            except Exception:  # noqa: BLE001 - the broker may still be settling; look again
                return False

        await wait_for(all_on_topic, timeout=120, what="every answered decision on the decisions topic again")
        assert server.rt.relay.replayed >= KILL_AFTER, "the acknowledged decisions the broker lost were sent again"

        def delivered() -> set[str]:
            return {e["run"]["facets"]["budget"]["decision_id"] for e in marquez.received()}

        await wait_for(lambda: answered <= delivered(), timeout=120, what="every decision delivered as evidence")
    finally:
        await emitter.stop()
    assert delivered() - answered == set(), "no evidence of a decision that was never answered"
