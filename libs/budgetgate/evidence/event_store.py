"""The evidence store in Postgres: events the evidence-emitter stored when consumed, then marked
delivered (or dead) by its sender, and the dead-lettered ones listed and put back to be sent
(`budgetgate evidence`). Its SQL is evidence/queries.sql."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.evidence")


@dataclass(frozen=True)
class StoredEvent:
    """One event for the outbox-like delivery table."""

    source_event_id: str
    stage: str
    run_id: str
    run_uuid: uuid.UUID
    decision_id: str | None
    event_type: str
    event_time: datetime
    payload: dict[str, Any]
    state: str = "pending"  # or "waiting" (a reconciliation before its decision)


@dataclass(frozen=True)
class Pending:
    seq: int
    payload: dict[str, Any]
    attempts: int


@dataclass(frozen=True)
class Backlog:
    pending: int
    oldest_seconds: float


@dataclass(frozen=True)
class ReconciliationRow:
    event_id: str
    run_id: str
    decision_id: str | None
    final_state: str
    terminal: bool
    provisional: bool
    policy_git_sha: str
    projected_gpu: int
    actual_gpu: int
    reconciled_at: datetime
    # One per ledger key: (ledger_key, scope_id, window_key, window_start, window_end, policy_id, unit, amount)
    charges: tuple[tuple[Any, ...], ...]


async def add_event(conn: asyncpg.Connection, event: StoredEvent) -> None:
    await conn.execute(
        sql("evidence_insert_event"),
        event.source_event_id,
        event.stage,
        event.run_id,
        event.run_uuid,
        event.decision_id,
        event.event_type,
        event.event_time,
        json.dumps(event.payload),
        event.state,
    )


async def waiting_for_run(conn: asyncpg.Connection, run_id: str) -> list[tuple[int, dict[str, Any]]]:
    """The run's events waiting for their decision, locked until the transaction ends."""
    return [(r["seq"], json.loads(r["payload"])) for r in await conn.fetch(sql("evidence_waiting_for_run"), run_id)]


async def settle_waiting(conn: asyncpg.Connection, seq: int, payload: dict[str, Any]) -> None:
    await conn.execute(sql("evidence_settle_waiting"), seq, json.dumps(payload), payload["eventType"])


async def waiting_decided(pool: asyncpg.Pool, limit: int = 100) -> list[str]:
    """Runs with a reconciliation waiting for a decision that is stored by now."""
    return [r["run_id"] for r in await pool.fetch(sql("evidence_waiting_decided"), limit)]


async def release_stale(pool: asyncpg.Pool, older_than_seconds: float) -> None:
    await pool.execute(sql("evidence_release_stale"), older_than_seconds)


async def decision_event(conn: asyncpg.Connection, run_id: str, decision_id: str | None) -> dict[str, Any] | None:
    """The stored event of the run's decision (`decision_id`'s when known), or None."""
    raw = await conn.fetchval(sql("evidence_decision_event"), run_id, decision_id)
    return json.loads(raw) if raw is not None else None


async def terminal_sent(conn: asyncpg.Connection, run_id: str) -> bool:
    return bool(await conn.fetchval(sql("evidence_terminal_sent"), run_id))


async def add_reconciliation(conn: asyncpg.Connection, row: ReconciliationRow) -> None:
    await conn.execute(
        sql("evidence_insert_reconciliation"),
        row.event_id,
        row.run_id,
        row.decision_id,
        row.final_state,
        row.terminal,
        row.provisional,
        row.policy_git_sha,
        row.projected_gpu,
        row.actual_gpu,
        row.reconciled_at,
    )
    if row.charges:
        columns = list(zip(*row.charges, strict=True))
        await conn.execute(sql("evidence_insert_charges"), row.event_id, *[list(c) for c in columns])


async def next_batch(pool: asyncpg.Pool, limit: int) -> list[Pending]:
    rows = await pool.fetch(sql("evidence_next_batch"), limit)
    return [Pending(r["seq"], json.loads(r["payload"]), r["attempts"]) for r in rows]


async def mark_delivered(pool: asyncpg.Pool, seq: int) -> None:
    await pool.execute(sql("evidence_mark_delivered"), seq)


async def mark_retry(pool: asyncpg.Pool, seq: int, *, error: str, after_seconds: float) -> None:
    await pool.execute(sql("evidence_mark_retry"), seq, error[:2000], after_seconds)


async def mark_dead(pool: asyncpg.Pool, seq: int, *, status: int | None, body: str, error: str) -> None:
    await pool.execute(sql("evidence_mark_dead"), seq, status, body, error[:2000])


async def dead(conn: asyncpg.Connection | asyncpg.Pool, *, seqs: list[int] | None = None, limit: int = 1000) -> list[asyncpg.Record]:
    """Dead-lettered events (those of `seqs`, else all), oldest first."""
    return list(await conn.fetch(sql("evidence_dead_list"), seqs, limit))


async def resend(conn: asyncpg.Connection | asyncpg.Pool, *, seqs: list[int] | None = None) -> list[int]:
    """Put dead-lettered events (those of `seqs`, else all) back to be sent; returns their seqs."""
    return [row["seq"] for row in await conn.fetch(sql("evidence_resend"), seqs)]


async def backlog(pool: asyncpg.Pool) -> Backlog:
    row = await pool.fetchrow(sql("evidence_backlog"))
    assert row is not None
    return Backlog(row["pending"], row["oldest_seconds"])
