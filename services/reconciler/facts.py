"""The reconciler's Kafka handlers: each records one fact (a lifecycle event, a usage record) and
marks its run to be settled, in the inbox consumer's transaction. Settling happens right after,
in a transaction of its own (settler.py), so the Redis change and the Postgres commit that
carries it stay together; a crash in between leaves the mark, and the run is settled on restart.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC

import asyncpg
from aiokafka import ConsumerRecord

from budgetgate.consumer import Poison, Route
from budgetgate.core.reconciliation import LIFECYCLE_KINDS
from budgetgate.ledger.queries import sql
from budgetgate.topics import Topics
from budgetgate.v1 import lifecycle_pb2, usage_pb2

MAX_RUN_ID = 256


def routes(topics: Topics, *, on_fact: Callable[[str], None]) -> dict[str, Route]:
    """Routes for InboxConsumer: lifecycle events and usage records."""

    async def lifecycle(conn: asyncpg.Connection, event: lifecycle_pb2.LifecycleEvent, _record: ConsumerRecord) -> None:
        run_id = _run_id(event.run_id)
        kind = lifecycle_pb2.LifecycleType.Name(event.type) if event.type in lifecycle_pb2.LifecycleType.values() else ""
        if kind not in LIFECYCLE_KINDS:
            raise Poison(f"lifecycle event {event.event_id} has no known type ({event.type})")
        if not event.HasField("event_time"):
            raise Poison(f"lifecycle event {event.event_id} has no event_time")
        if event.gpus < 0 or event.nodes < 0:
            raise Poison(f"lifecycle event {event.event_id} reports negative resources")
        at = event.event_time.ToDatetime(tzinfo=UTC)
        new = await conn.fetchval(sql("record_lifecycle"), event.event_id, run_id, kind, at, event.gpus, event.nodes, event.flavor or None, event.reason or None)
        if new:
            await conn.execute(sql("mark_to_settle"), run_id)
            on_fact(run_id)

    async def usage(conn: asyncpg.Connection, record: usage_pb2.UsageRecord, _record: ConsumerRecord) -> None:
        run_id = _run_id(record.run_id)
        if not record.sample_id:
            raise Poison(f"usage record {record.event_id} has no sample_id")
        if not record.HasField("observed_at"):
            raise Poison(f"usage record {record.event_id} has no observed_at")
        # The sample's own counters when the producer gives them, else the run's high-water mark.
        gpu = record.gpu_milli_hours_observed if record.HasField("gpu_milli_hours_observed") else record.gpu_milli_hours_cumulative
        node = record.node_milli_hours_observed if record.HasField("node_milli_hours_observed") else record.node_milli_hours_cumulative
        if gpu < 0 or node < 0:
            raise Poison(f"usage record {record.event_id} has negative counters")
        at = record.observed_at.ToDatetime(tzinfo=UTC)
        if await conn.fetchval(sql("record_sample"), run_id, record.sample_id, at, gpu, node):
            await conn.execute(sql("mark_to_settle"), run_id)
            on_fact(run_id)

    return {
        topics.lifecycle: Route(lifecycle_pb2.LifecycleEvent, lifecycle),
        topics.usage: Route(usage_pb2.UsageRecord, usage),
    }


def _run_id(run_id: str) -> str:
    if not run_id or len(run_id) > MAX_RUN_ID:
        raise Poison(f"run_id must be 1 to {MAX_RUN_ID} characters")
    return run_id

