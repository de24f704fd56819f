"""API tokens for tests: every service runs with authentication on, so every test caller
carries a token made in the test's own database."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import timedelta

import asyncpg

from budgetgate.principals import Role
from budgetgate.tokens import create_token

ALL_ROLES = tuple(Role)


async def issue(dsn: str, *roles: Role, namespaces: Iterable[str] = (), tenants: Iterable[str] = (), name: str | None = None, expires_in: timedelta | None = None) -> str:
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
