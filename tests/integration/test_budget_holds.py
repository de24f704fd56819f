"""Lifting a budget hold on real Postgres: once, by one reconciler, and never on a budget a
settlement in flight is exhausting again (services/reconciler/budget_actions.py lift_holds)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest

from budgetgate.services.reconciler import budget_actions
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.v1 import actions_pb2
from tests.support.admission import apply_policies, budget_yaml
from tests.support.pg_sessions import wait_done_or_blocked
from tests.support.reconciler import outbox

KEY = "held-key"
LIMIT = 10_000


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A hold on budget `held` (on_exhausted: hold) whose limit was raised above what it consumed."""
    await apply_policies(pg_dsn, {"h.yaml": budget_yaml("held", limit="gpu_hours: 10", on_exhausted="hold")}, sha="a" * 40)
    async with asyncpg.create_pool(pg_dsn, min_size=2, max_size=4) as pool:
        await pool.execute(
            "INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount, consumed)"
            " VALUES ($1, 'ns=vision-prod;team=vision', 'gpu_hours', 'w', now() - interval '1 day', now() + interval '1 day', 'held', $2, $3, $4)",
            KEY, "a" * 40, LIMIT, LIMIT - 1,
        )  # fmt: skip
        await pool.execute(
            "INSERT INTO budget_holds (ledger_key, policy_id, scope_id, on_exhausted) VALUES ($1, 'held', 'ns=vision-prod;team=vision', 'hold')", KEY
        )
        yield pool


async def bundles(pool: asyncpg.Pool) -> PolicyStore:
    found = PolicyStore()
    async with pool.acquire() as conn:
        await found.refresh(conn)
    return found


async def releases(dsn: str) -> int:
    return sum(a.type == actions_pb2.RELEASE_HOLD for a in await outbox(dsn, "budget.actions.v1", actions_pb2.BudgetAction))


async def test_a_hold_is_lifted_once_and_announced_once(pool: asyncpg.Pool, pg_dsn: str) -> None:
    found = await bundles(pool)
    assert await budget_actions.lift_holds(pool, bundles=found, now=datetime.now(UTC)) == [KEY]
    assert await budget_actions.lift_holds(pool, bundles=found, now=datetime.now(UTC)) == []
    assert await releases(pg_dsn) == 1


async def test_a_hold_another_reconciler_is_lifting_is_not_announced_twice(pool: asyncpg.Pool, pg_dsn: str) -> None:
    """Another replica has lifted the hold and not committed yet: this one leaves it to it."""
    found = await bundles(pool)
    async with pool.acquire() as other, other.transaction():
        await other.execute("DELETE FROM budget_holds WHERE ledger_key = $1", KEY)
        lifting = asyncio.create_task(budget_actions.lift_holds(pool, bundles=found, now=datetime.now(UTC)))
        await wait_done_or_blocked(lifting, other)
    assert await lifting == []
    assert await releases(pg_dsn) == 0


async def test_a_hold_whose_budget_a_settlement_is_exhausting_stays(pool: asyncpg.Pool, pg_dsn: str) -> None:
    """A settlement in flight has its ledger entry locked and consumed the rest: the room read
    before it commits is gone, so the hold is not lifted (then or after)."""
    found = await bundles(pool)
    async with pool.acquire() as settling, settling.transaction():
        await settling.execute("UPDATE ledger_entries SET consumed = $2 WHERE ledger_key = $1", KEY, LIMIT)
        lifting = asyncio.create_task(budget_actions.lift_holds(pool, bundles=found, now=datetime.now(UTC)))
        await wait_done_or_blocked(lifting, settling)
    assert await lifting == []
    assert await budget_actions.lift_holds(pool, bundles=found, now=datetime.now(UTC)) == []
    assert await pool.fetchval("SELECT count(*) FROM budget_holds") == 1
    assert await releases(pg_dsn) == 0
