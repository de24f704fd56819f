"""What the stores hold once the stack has settled, as the history's `observation` line: the
ledger, decisions, usage, the decisions topic read from its start, the evidence stand-in's
events, and the drift check of Redis against Postgres (budgetgate.ledger.drift, not repairing)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition

from budgetgate.chaos.cluster import REDIS_PREFIX, Cluster
from budgetgate.contracts import wire
from budgetgate.contracts.topics import Topics
from budgetgate.ledger import drift
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.v1.decisions_pb2 import Decision

QUERIES = {
    "ledger_entries": "SELECT ledger_key, policy_id, unit, limit_amount AS limit, consumed FROM ledger_entries ORDER BY ledger_key",
    "reservations": """SELECT run_id, ledger_key, decision_id::text, amount, state,
                              extract(epoch FROM now() - created_at)::float8 AS age_seconds FROM reservations ORDER BY run_id, ledger_key""",
    "decisions": "SELECT decision_id::text, run_id, attempt, outcome FROM decisions ORDER BY decided_at",
    "usage_records": "SELECT run_id, sample_id, gpu_milli_hours_delta AS gpu_delta FROM usage_records ORDER BY run_id, sample_id",
    "usage_runs": "SELECT run_id, gpu_milli_hours_cumulative AS gpu_cumulative FROM usage_runs ORDER BY run_id",
    "metering_pending": "SELECT run_id, sample_id FROM metering_pending ORDER BY run_id, sample_id",
}


async def observe(cluster: Cluster, *, at: float, echo: Callable[[str], None], wait: float = 60.0) -> dict[str, Any]:
    conn = await asyncpg.connect(cluster.dsn, timeout=10)
    try:
        found: dict[str, Any] = {name: [dict(r) for r in await conn.fetch(query)] for name, query in QUERIES.items()}
    finally:
        await conn.close()
    decided = {d["decision_id"] for d in found["decisions"]}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not decided <= {e["decision_id"] for e in cluster.sink.decision_events()}:
        await asyncio.sleep(1.0)
    found["evidence"] = [e for e in cluster.sink.decision_events() if e.get("stage") in (None, "decision")]
    try:
        found["topic_decisions"] = sorted(await decisions_on_topic(cluster.bootstrap))
        found["topic_read"] = True
    except Exception as exc:  # noqa: BLE001 - the broker may be unreachable: said, not judged
        echo(f"the decisions topic could not be read: {exc}")
        found["topic_decisions"], found["topic_read"] = [], False
    found["redis_drift"] = await redis_drift(cluster)
    found.update(type="observation", at=at)
    return found


async def decisions_on_topic(bootstrap: str, *, quiet_polls: int = 3) -> set[str]:
    topic = Topics("").decisions
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        for _ in range(20):
            if partitions:
                break
            await consumer._client.force_metadata_update()  # noqa: SLF001 - a topic just made again
            partitions = consumer.partitions_for_topic(topic) or set()
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        await consumer.seek_to_beginning()
        seen: set[str] = set()
        idle = 0
        while idle < quiet_polls:
            batch = await consumer.getmany(timeout_ms=1000)
            records = [r for rs in batch.values() for r in rs]
            idle = 0 if records else idle + 1
            for record in records:
                try:
                    message = wire.decode(Decision, record.value, record.headers)
                except wire.WireError:
                    continue
                seen.add(message.decision_id or message.event_id)
        return seen
    finally:
        await consumer.stop()


async def redis_drift(cluster: Cluster, *, tries: int = 10) -> dict[str, Any]:
    """The drift check, asked again a few times: a difference may be a change in flight."""

    async def no_rebuild(_conn: asyncpg.Connection) -> None:
        raise RuntimeError("the campaign compares, it never rebuilds")

    result: dict[str, Any] = {"loaded": False, "keys": {}, "runs": {}, "counters": {}, "pools": {}}
    pool = await asyncpg.create_pool(cluster.dsn, min_size=1, max_size=2)
    client = aioredis.Redis(port=cluster.redis.primary.port)
    try:
        for _ in range(tries):
            found = await drift.check(pool, RedisLedger(client, prefix=REDIS_PREFIX), repair=False, rebuild=no_rebuild)
            if found is None:
                result = {"loaded": False, "keys": {}, "runs": {}, "counters": {}, "pools": {}}
            else:
                result = {
                    "loaded": True,
                    "keys": {k: [list(a), list(b)] for k, (a, b) in found.keys.items()},
                    "runs": {k: [a, b] for k, (a, b) in found.runs.items()},
                    "counters": {k: [list(a), list(b)] for k, (a, b) in found.counters.items()},
                    "pools": {k: [sorted(a), sorted(b)] for k, (a, b) in found.pools.items()},
                }
                if found.clean:
                    return result
            await asyncio.sleep(2.0)
        return result
    finally:
        await client.aclose()
        await pool.close()
