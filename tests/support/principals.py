"""API tokens for tests: every service runs with authentication on, so every test caller
carries a token made in the test's own database."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import timedelta

from typing import Any

import asyncpg
import pytest

from budgetgate.core.principals import Role
from budgetgate.access.tokens import create_token
from budgetgate.runtime import redis_client

ALL_ROLES = tuple(Role)


async def issue(
    dsn: str, *roles: Role, namespaces: Iterable[str] = (), tenants: Iterable[str] = (), name: str | None = None, expires_in: timedelta | None = None
) -> str:
    """A new token's secret (every role when none is named)."""
    conn = await asyncpg.connect(dsn)
    try:
        token = await create_token(
            conn, name=name or f"test-{uuid.uuid4().hex[:12]}", roles=list(roles or ALL_ROLES), namespaces=list(namespaces), tenants=list(tenants),
            created_by="tests", expires_in=expires_in,
        )  # fmt: skip
    finally:
        await conn.close()
    return token.secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


# What a refusal must leave as it was.
_LEDGER_TABLES = ("decisions", "reservations", "run_holds", "pool_allocations", "usage_records", "outbox", "ledger_entries", "policy_bundles")


async def ledger_state(dsn: str, redis_url: str, prefix: str) -> dict[str, Any]:
    """Every ledger row (as text) and every Redis value under the test's prefix."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = {t: sorted(str(dict(r)) for r in await conn.fetch(f"SELECT * FROM {t}")) for t in _LEDGER_TABLES if t != "outbox"}  # noqa: S608 - fixed names
        # What the outbox holds, not the relay's bookkeeping of when it published a row.
        rows["outbox"] = sorted(str(dict(r)) for r in await conn.fetch("SELECT id, topic, key, payload FROM outbox"))
    finally:
        await conn.close()
    client = redis_client.connect(redis_url)
    try:
        keys = sorted([k async for k in client.scan_iter(match=f"{{{prefix}}}*")])
        rows["redis"] = [(k, await client.dump(k)) for k in keys if b"ratelimit" not in k]
    finally:
        await client.aclose()
    return rows


@pytest.fixture
async def token_in_env(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A token of every role in the test's database, as BUDGETGATE_TOKEN (what budgetgate.client reads)."""
    secret = await issue(pg_dsn)
    monkeypatch.setenv("BUDGETGATE_TOKEN", secret)
    return secret
