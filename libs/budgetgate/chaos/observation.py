"""What the stores hold once the stack has settled, as the history's `observation` line: the
ledger, decisions, usage, the decisions topic read from its start, the evidence stand-in's
events, and the drift check of Redis against Postgres (budgetgate.ledger.drift, not repairing).

A decision missing from the stand-in gets its trail (`evidence_trail`), so a violation can be
diagnosed from the history alone: where it sits on the topic, whether the evidence-emitter's inbox
took it, its evidence row (state, attempts, last error), and the emitter group's committed offset
and the log's end on that partition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, TopicPartition

from budgetgate.chaos.cluster import Cluster, shard_ledgers
from budgetgate.contracts import wire
from budgetgate.contracts.topics import Topics
from budgetgate.ledger import drift
from budgetgate.v1.decisions_pb2 import Decision

# The evidence-emitter's consumer group, after the deployment's topic prefix (none in the
# campaign's stack).
EMITTER_GROUP = "budgetgate-evidence-emitter"

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
    placed: dict[str, dict[str, Any]] = {}
    try:
        async with asyncio.timeout(wait):  # (a broker that hangs is said, not waited on)
            placed = await decisions_on_topic(cluster.bootstrap)
        found["topic_decisions"] = sorted(placed)
        found["topic_read"] = True
    except Exception as exc:  # noqa: BLE001 - the broker may be unreachable: said, not judged
        echo(f"the decisions topic could not be read: {exc}")
        found["topic_decisions"], found["topic_read"] = [], False
    missing = sorted(decided - {e["decision_id"] for e in found["evidence"]})
    if missing:
        try:
            async with asyncio.timeout(wait):
                found["evidence_trail"] = await evidence_trail(cluster.dsn, cluster.bootstrap, missing, placed)
        except Exception as exc:  # noqa: BLE001 - a diagnosis that fails must not cost the observation
            echo(f"the trail of the decisions missing from the evidence could not be read: {exc!r}")
    found["redis_drift"] = await redis_drift(cluster, echo=echo)
    found.update(type="observation", at=at)
    return found


LOCK_HOLDERS = """
SELECT a.pid, l.mode, a.application_name, a.state, a.xact_start::text, left(a.query, 200) AS query
FROM pg_locks l JOIN pg_stat_activity a USING (pid)
WHERE l.locktype = 'advisory' AND l.classid = 7301 AND l.objid = $1 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


async def evidence_trail(dsn: str, bootstrap: str, missing: list[str], placed: dict[str, dict[str, Any]], *, prefix: str = "") -> dict[str, dict[str, Any]]:
    """For each decision id in `missing` (not in the stand-in): its place on the decisions topic,
    whether the emitter's inbox took its record, its evidence rows, the emitter group's
    committed offset and the log's end on its partition, and how many partitions the topic has."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch(
            """SELECT decision_id, stage, state, attempts, last_error, event_type,
                      extract(epoch FROM next_attempt_at - now())::float8 AS next_attempt_in,
                      extract(epoch FROM now() - created_at)::float8 AS age_seconds
               FROM evidence_events WHERE decision_id = ANY($1::text[])""",
            missing,
        )
        events = [p["event_id"] for d in missing if (p := placed.get(d))]
        took = await conn.fetch("SELECT event_id FROM inbox WHERE consumer = 'evidence_emitter' AND event_id = ANY($1::text[])", events)
        taken = {r["event_id"] for r in took}
    finally:
        await conn.close()
    group: dict[str, Any] = {}
    try:
        group = await emitter_group(bootstrap, prefix=prefix)
    except Exception as exc:  # noqa: BLE001 - said in the trail, not judged
        group = {"error": repr(exc)}
    trail = {}
    for decision_id in missing:
        where = placed.get(decision_id)
        trail[decision_id] = {
            "topic": where,
            "inbox_took": where is not None and where["event_id"] in taken,
            "evidence_rows": [dict(r) for r in rows if r["decision_id"] == decision_id],
            "emitter_group": group.get(str(where["partition"])) if where else group,
            # More than the deployment creates: the broker made the topic anew on its own.
            "topic_partitions": None if "error" in group else len(group),
        }
    return trail


async def emitter_group(bootstrap: str, *, prefix: str = "") -> dict[str, Any]:
    """The evidence-emitter group's committed offset and the log's end, per decisions partition
    (read by a consumer of the group that never joins it: an offset fetch, not a rebalance)."""
    topic = Topics(prefix).decisions
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=prefix + EMITTER_GROUP, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        ends = await consumer.end_offsets(partitions) if partitions else {}
        return {str(tp.partition): {"committed": await consumer.committed(tp), "end_reported": ends.get(tp)} for tp in partitions}
    finally:
        await consumer.stop()


async def decisions_on_topic(bootstrap: str, *, prefix: str = "", quiet_polls: int = 3) -> dict[str, dict[str, Any]]:
    """Every decision on the decisions topic (under `prefix`) read from its start: its id, with
    the partition, offset and event id of its first record there."""
    topic = Topics(prefix).decisions
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
        seen: dict[str, dict[str, Any]] = {}
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
                seen.setdefault(message.decision_id or message.event_id, {"partition": record.partition, "offset": record.offset, "event_id": message.event_id})
        return seen
    finally:
        await consumer.stop()


# The longest the drift check waits for a shard's ledger lock, held exclusively to confirm a
# difference (drift.py): once recovered, nothing holds it longer. A campaign hung here for more
# than 4 minutes once in CI (2026-12-01), with no word of who held it; now it says so.
LOCK_WAIT = "20s"


async def redis_drift(cluster: Cluster, *, tries: int = 10, echo: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """The drift check, asked again a few times: a difference may be a change in flight. A
    shard's ledger lock that stays held (LOCK_WAIT) ends the check, read as not loaded (the
    redis checker's violation), with the sessions holding it named (`locked_by`)."""

    async def no_rebuild(_conn: asyncpg.Connection) -> None:
        raise RuntimeError("the campaign compares, it never rebuilds")

    result: dict[str, Any] = {"loaded": False, "keys": {}, "runs": {}, "counters": {}, "pools": {}, "sizes": {}}
    pool = await asyncpg.create_pool(cluster.dsn, min_size=1, max_size=2, server_settings={"lock_timeout": LOCK_WAIT})
    client = aioredis.Redis(port=cluster.redis.primary.port)
    try:
        for _ in range(tries):
            result = {"loaded": True, "keys": {}, "runs": {}, "counters": {}, "pools": {}, "sizes": {}}
            clean = True
            for ledger in shard_ledgers(client, cluster.ledger_shards):  # shard by shard, as the reconciler checks
                try:
                    found = await drift.check(pool, ledger, repair=False, rebuild=no_rebuild)
                except asyncpg.LockNotAvailableError:
                    holders = [dict(r) for r in await pool.fetch(LOCK_HOLDERS, ledger.shard)]
                    echo(f"the drift check waited more than {LOCK_WAIT} for shard {ledger.shard}'s ledger lock, held by {holders}")
                    return {"loaded": False, "keys": {}, "runs": {}, "counters": {}, "pools": {}, "sizes": {}, "locked_by": holders}
                if found is None:
                    result, clean = {"loaded": False, "keys": {}, "runs": {}, "counters": {}, "pools": {}, "sizes": {}}, False
                    break
                result["keys"].update({k: [list(a), list(b)] for k, (a, b) in found.keys.items()})
                result["runs"].update({k: [a, b] for k, (a, b) in found.runs.items()})
                result["counters"].update({k: [list(a), list(b)] for k, (a, b) in found.counters.items()})
                result["pools"].update({k: [sorted(a), sorted(b)] for k, (a, b) in found.pools.items()})
                result["sizes"].update({k: list(pair) for k, pair in found.sizes.items()})
                clean = clean and found.clean
            if clean:
                return result
            await asyncio.sleep(2.0)
        return result
    finally:
        await client.aclose()
        await pool.close()
