"""API tokens kept in Postgres as a SHA-256 of their secret, and the administrative log.

A secret is 32 random bytes (URL-safe, prefixed `bg_`): with that much entropy a plain SHA-256
is as good as a slow hash, and lets a lookup be one indexed equality. The secret is returned
once, by `create`; only its hash is stored. No secret is ever compared: the lookup compares
digests, and what its timing could reveal (how much of a stored SHA-256 a guess's digest
shares) gives no way to a secret."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from budgetgate.ledger.queries import sql
from budgetgate.principals import Principal, Role

PREFIX = "bg_"


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


@dataclass(frozen=True)
class IssuedToken:
    name: str
    secret: str
    expires_at: datetime | None


async def create_token(
    conn: Any, *, name: str, roles: list[Role], namespaces: list[str], tenants: list[str], created_by: str, expires_in: timedelta | None = None
) -> IssuedToken:
    """Store a new token (and log who created it, in the same transaction); the secret is in the answer only."""
    secret = new_secret()
    expires = datetime.now(UTC) + expires_in if expires_in else None
    async with conn.transaction():
        await conn.execute(sql("create_api_token"), uuid.uuid4(), name, secret_hash(secret), [str(r) for r in roles], namespaces, tenants, created_by, expires)
        details = {"roles": [str(r) for r in roles], "namespaces": namespaces, "tenants": tenants, "expires_at": expires.isoformat() if expires else None}
        await log_action(conn, actor=created_by, action="token.create", subject=name, details=details)
    return IssuedToken(name=name, secret=secret, expires_at=expires)


async def revoke_token(conn: Any, *, name: str, revoked_by: str) -> bool:
    """Revoke a live token by name; False when none is live under that name."""
    async with conn.transaction():
        revoked = await conn.fetchval(sql("revoke_api_token"), name)
        if revoked is not None:
            await log_action(conn, actor=revoked_by, action="token.revoke", subject=name, details={})
    return revoked is not None


async def list_tokens(conn: Any) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(sql("list_api_tokens"))]


async def log_action(conn: Any, *, actor: str, action: str, subject: str, details: dict[str, Any]) -> None:
    await conn.execute(sql("log_admin_action"), actor, action, subject, json.dumps(details))


async def admin_log(conn: Any, *, limit: int = 100) -> list[dict[str, Any]]:
    rows = await conn.fetch(sql("admin_log"), limit)
    return [{**dict(r), "details": json.loads(r["details"]) if isinstance(r["details"], str) else r["details"]} for r in rows]


class TokenStore:
    """Resolves a secret to its principal. Answers are cached for `cache_seconds` (found or
    not), so a revocation or expiry takes effect on every instance within that time."""

    def __init__(self, pool: Any, *, cache_seconds: float = 2.0, max_entries: int = 10_000) -> None:
        self.pool = pool
        self.cache_seconds = cache_seconds
        self.max_entries = max_entries
        self._cache: dict[bytes, tuple[float, Principal | None, datetime | None]] = {}

    async def principal(self, secret: str) -> Principal | None:
        digest = secret_hash(secret)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now and (hit[2] is None or hit[2] > datetime.now(UTC)):
            return hit[1]
        row = await self.pool.fetchrow(sql("api_token_by_hash"), digest)
        found = Principal.of(f"token:{row['name']}", row["roles"], namespaces=row["namespaces"], tenants=row["tenants"]) if row else None
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[digest] = (now + self.cache_seconds, found, row["expires_at"] if row else None)
        return found
