"""The local stack's API tokens: one per role, unscoped, issued by `dev up`."""

from __future__ import annotations

import secrets

import asyncpg

from budgetgate.core.principals import Role
from budgetgate.access.tokens import create_token, list_tokens, revoke_token

ISSUER = "budgetgate dev up"


async def issue_dev_tokens(dsn: str) -> dict[str, str]:
    """Revoke the tokens an earlier `dev up` issued on this database and issue new ones; role -> secret."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        for token in await list_tokens(conn):
            if token["created_by"] == ISSUER and token["revoked_at"] is None:
                await revoke_token(conn, name=token["name"], revoked_by=ISSUER)
        suffix = secrets.token_hex(3)
        issued = {}
        for role in Role:
            token = await create_token(conn, name=f"dev-{role}-{suffix}", roles=[role], namespaces=[], tenants=[], created_by=ISSUER)
            issued[str(role)] = token.secret
        return issued
    finally:
        await conn.close()
