"""A decision missing from the evidence stand-in gets its trail in the campaign's observation
(docs/promises.md): where it sits on the decisions topic, whether the emitter's inbox took it, its
evidence rows, and the emitter group's committed offset and the log's end on its partition."""

from __future__ import annotations

import uuid

import asyncpg
from aiokafka import AIOKafkaProducer
from google.protobuf.timestamp_pb2 import Timestamp

from budgetgate.chaos import campaign
from budgetgate.chaos.observation import LOCK_HOLDERS, decisions_on_topic, evidence_trail
from budgetgate.contracts import wire
from budgetgate.contracts.topics import Topics
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.runtime import redis_client
from budgetgate.v1.decisions_pb2 import Decision


async def test_a_decision_missing_from_the_evidence_gets_its_trail(killable_kafka, pg_dsn) -> None:
    bootstrap = killable_kafka.url
    await ensure_topics(bootstrap)
    taken, untaken = str(uuid.uuid4()), str(uuid.uuid4())
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for decision_id in (taken, untaken):
            message = Decision(event_id=f"e-{decision_id}", decision_id=decision_id, run_id=f"run-{decision_id}", event_time=Timestamp(seconds=1_700_000_000))
            record = wire.encode(message, key=message.run_id)
            await producer.send_and_wait(Topics("").decisions, record.value, key=record.key, headers=record.headers)
    finally:
        await producer.stop()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("INSERT INTO inbox (consumer, event_id, topic) VALUES ('evidence_emitter', $1, 'budget.decisions.v1')", f"e-{taken}")
        await conn.execute(
            "INSERT INTO evidence_events (source_event_id, stage, run_id, run_uuid, decision_id, event_type, event_time, payload, state, attempts, last_error)"
            " VALUES ($1, 'decision', $2, $3, $4, 'OTHER', now(), '{}', 'pending', 3, 'HTTP 503')",
            f"e-{taken}", f"run-{taken}", uuid.uuid4(), taken,
        )  # fmt: skip
    finally:
        await conn.close()

    placed = await decisions_on_topic(bootstrap)
    assert set(placed) == {taken, untaken}
    trail = await evidence_trail(pg_dsn, bootstrap, [taken, untaken], placed)

    assert trail[taken]["topic"] == placed[taken] and trail[taken]["inbox_took"] is True
    [row] = trail[taken]["evidence_rows"]
    assert (row["state"], row["attempts"], row["last_error"]) == ("pending", 3, "HTTP 503")
    assert trail[untaken]["inbox_took"] is False and trail[untaken]["evidence_rows"] == []
    # No emitter ever committed: the partition's end is there, the committed offset is not.
    group = trail[untaken]["emitter_group"]
    assert group["committed"] is None and group["end_reported"] >= 1
    assert trail[untaken]["topic_partitions"] == 3  # as ensure_topics made it


async def test_a_redis_key_over_its_limit_is_sampled_with_its_holds_and_those_postgres_ended(pg_dsn: str, redis_url: str, redis_prefix: str) -> None:
    """The ledger sampler (seed 20261203): a Redis key over its limit comes with the runs that
    hold on it and, of those, the ones whose reservation Postgres has ended, matched by decision;
    a key within its limit comes with neither."""
    client = redis_client.connect(redis_url)
    ledger = RedisLedger(client, prefix=redis_prefix)
    ended, held, other = (str(uuid.uuid4()) for _ in range(3))
    conn = await asyncpg.connect(pg_dsn)
    try:
        for run_id, decision_id, state in (("r-ended", ended, "released"), ("r-held", held, "held")):
            keys_row = "INSERT INTO decision_keys (decision_id, run_id, attempt, outcome, decided_at) VALUES ($1, $2, 1, 'ALLOW', now())"
            await conn.execute(keys_row, uuid.UUID(decision_id), run_id)
            await conn.execute(
                "INSERT INTO reservations (run_id, ledger_key, decision_id, amount, state, expected_end) VALUES ($1, 'k-over', $2, 60, $3, now())",
                run_id, uuid.UUID(decision_id), state,
            )  # fmt: skip
    finally:
        await conn.close()
    await client.hset(ledger.ledger("k-over"), mapping={"reserved": 180, "consumed": 30})
    await client.hset(ledger.ledger("k-within"), mapping={"reserved": 0, "consumed": 10})
    # r-ended: ended in Postgres, held again in Redis; r-held: held in both; r-other: held for
    # another decision than the one Postgres ended (another attempt, not committed yet).
    for run_id, decision_id in (("r-ended", ended), ("r-held", held), ("r-other", other)):
        await client.hset(ledger.run(run_id), mapping={ledger.ledger("k-over"): 60, "_decision": decision_id})
    keys = {"k-over": {"policy_id": "p", "limit": 200}, "k-within": {"policy_id": "p", "limit": 200}}
    try:
        figures = await campaign._redis_figures(ledger, keys)
        await campaign._ended_in_postgres(pg_dsn, {k: f for k, f in figures.items() if "runs" in f})
    finally:
        await client.aclose()

    assert figures["k-within"] == {"policy_id": "p", "limit": 200, "held": 0, "consumed": 10}
    over = figures["k-over"]
    assert over["held"] == 180 and set(over["runs"]) == {"r-ended", "r-held", "r-other"}
    assert over["runs"]["r-ended"] == {"amount": 60, "decision_id": ended}
    assert over["ended_in_postgres"] == ["r-ended"]


async def test_the_observation_names_who_holds_a_shards_ledger_lock(pg_dsn: str) -> None:
    """A drift check that waits past LOCK_WAIT for a shard's ledger lock ends and names the
    sessions holding it (a campaign once hung there for minutes with no word of who)."""
    holder = await asyncpg.connect(pg_dsn, server_settings={"application_name": "holding-the-ledger"})
    reader = await asyncpg.connect(pg_dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock_shared(7301, 2)")
        held = await reader.fetch(LOCK_HOLDERS, 2)
        assert [(r["application_name"], r["mode"]) for r in held] == [("holding-the-ledger", "ShareLock")]
        assert await reader.fetch(LOCK_HOLDERS, 0) == []  # another shard's lock: nobody
    finally:
        await holder.close()
        await reader.close()
