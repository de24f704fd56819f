"""The reconciler's Kafka handlers: each batch of lifecycle events or usage records is recorded
with multi-row statements, and each run with a new fact is marked to be settled, in the inbox
consumer's transaction. Settling happens right after, in transactions of its own (settler.py);
a crash in between leaves the mark, and the run is settled on restart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC

import asyncpg

from budgetgate.contracts import lifecycle_rules as lifecycle
from budgetgate.messaging.inbox import BatchRoute, Delivery
from budgetgate.core.ledger_key import MAX_AMOUNT
from budgetgate.core.reconciliation import TERMINAL
from budgetgate.ledger.queries import owned_by
from budgetgate.contracts.timestamps import time_problem
from budgetgate.v1 import lifecycle_pb2, usage_pb2

sql = owned_by("budgetgate.services.reconciler")


def lifecycle_route(*, on_fact: Callable[[str], None]) -> BatchRoute:
    """The inbox route of lifecycle events, a batch at a time; `on_fact(run_id)` for each run marked."""

    async def lifecycle(conn: asyncpg.Connection, batch: Sequence[Delivery]) -> Mapping[Delivery, str]:
        refused, rows = {}, []
        for delivery in batch:
            event = delivery.message
            reason = _lifecycle_problem(event)
            if reason:
                refused[delivery] = reason
                continue
            kind = lifecycle_pb2.LifecycleType.Name(event.type)
            rows.append(
                (
                    event.event_id,
                    event.run_id,
                    kind,
                    event.event_time.ToDatetime(tzinfo=UTC),
                    event.gpus,
                    event.nodes,
                    event.flavor or None,
                    event.reason or None,
                )
            )
        if rows:
            new = await conn.fetch(sql("record_lifecycle_batch"), *map(list, zip(*rows, strict=True)))
            await _mark(conn, {r["run_id"] for r in new}, on_fact)
            ended = sorted({row[1] for row in rows if row[2] in TERMINAL})
            if ended:
                # A run the platform ended (cancelled while it waited, say) waits for nothing.
                await conn.execute(sql("forget_ended_waiting"), ended)
        return refused

    return BatchRoute(lifecycle_pb2.LifecycleEvent, lifecycle)


def usage_route(*, on_fact: Callable[[str], None]) -> BatchRoute:
    """The inbox route of usage records, a batch at a time; `on_fact(run_id)` for each run marked."""

    async def usage(conn: asyncpg.Connection, batch: Sequence[Delivery]) -> Mapping[Delivery, str]:
        refused, rows = {}, {}
        for delivery in batch:
            record = delivery.message
            reason = _usage_problem(record)
            if reason:
                refused[delivery] = reason
                continue
            # The sample's own counters when the producer gives them, else the run's high-water mark.
            gpu = record.gpu_milli_hours_observed if record.HasField("gpu_milli_hours_observed") else record.gpu_milli_hours_cumulative
            node = record.node_milli_hours_observed if record.HasField("node_milli_hours_observed") else record.node_milli_hours_cumulative
            # A sample id repeated within the batch counts once, as across batches: the first wins.
            rows.setdefault((record.run_id, record.sample_id), (record.run_id, record.sample_id, record.observed_at.ToDatetime(tzinfo=UTC), gpu, node))
        if rows:
            new = await conn.fetch(sql("record_samples"), *map(list, zip(*rows.values(), strict=True)))
            await _mark(conn, {r["run_id"] for r in new}, on_fact)
        return refused

    return BatchRoute(usage_pb2.UsageRecord, usage)


async def _mark(conn: asyncpg.Connection, run_ids: set[str], on_fact: Callable[[str], None]) -> None:
    if run_ids:
        await conn.execute(sql("mark_runs_to_settle"), sorted(run_ids))
        for run_id in run_ids:
            on_fact(run_id)


def _lifecycle_problem(event: lifecycle_pb2.LifecycleEvent) -> str | None:
    # The rules metering-ingest's HTTP lifecycle feed applies too (budgetgate/contracts/lifecycle_rules.py).
    found = lifecycle.problems(event)
    return found[0][1] if found else None


def _usage_problem(record: usage_pb2.UsageRecord) -> str | None:
    if reason := lifecycle.run_id_problem(record.run_id):
        return reason
    if not record.sample_id:
        return f"usage record {record.event_id} has no sample_id"
    if not record.HasField("observed_at"):
        return f"usage record {record.event_id} has no observed_at"
    if reason := time_problem(record.observed_at, "observed_at"):
        return f"usage record {record.event_id}: {reason}"
    counters = (record.gpu_milli_hours_observed, record.node_milli_hours_observed, record.gpu_milli_hours_cumulative, record.node_milli_hours_cumulative)
    if any(c < 0 for c in counters):
        return f"usage record {record.event_id} has negative counters"
    if any(c > MAX_AMOUNT for c in counters):
        return f"usage record {record.event_id} has a counter beyond the ledger's range ({MAX_AMOUNT})"
    return None
