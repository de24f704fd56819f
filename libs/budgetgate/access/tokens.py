"""API tokens kept in Postgres as a SHA-256 of their secret, and the administrative log.

A secret is 32 random bytes (URL-safe, prefixed `bg_`): with that much entropy a plain SHA-256
is as good as a slow hash, and lets a lookup be one indexed equality. The secret is returned
once, by `create`; only its hash is stored. No secret is ever compared: the lookup compares
digests, and what its timing could reveal (how much of a stored SHA-256 a guess's digest
shares) gives no way to a secret."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from cachetools import LRUCache, TTLCache

from budgetgate.ledger.queries import owned_by
from budgetgate.core.principals import Principal, Role

sql = owned_by("budgetgate.access")

PREFIX = "bg_"
# What new_secret makes: the prefix, then 32 bytes as unpadded URL-safe base64 (43 characters).
_SHAPE = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_-]{43}")


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def well_formed(secret: str) -> bool:
    """Whether `secret` has the shape of one `new_secret` makes (any other cannot be a token)."""
    return _SHAPE.fullmatch(secret) is not None


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
    not), so a revocation or expiry takes effect on every instance within that time.

    Found and unknown secrets are cached apart, each dropping its least recently used entry when
    full: a flood of made-up secrets can push out only other made-up secrets, never a caller's
    valid one. A secret not shaped like one `new_secret` makes is refused without a lookup, and
    concurrent lookups of one secret share a single query."""

    def __init__(self, pool: Any, *, cache_seconds: float = 2.0, max_entries: int = 10_000, max_unknown: int = 1_000) -> None:
        self.pool = pool
        self.cache_seconds = cache_seconds
        self.found: TTLCache[bytes, tuple[Principal, datetime | None]] = TTLCache(maxsize=max_entries, ttl=cache_seconds)
        self.unknown: TTLCache[bytes, bool] = TTLCache(maxsize=max_unknown, ttl=cache_seconds)
        # Secrets found valid before, kept past their cached answer: looked up again as usual
        # (a revocation still takes effect), but never refused as a flood's (see Gate.api_token).
        self.known: LRUCache[bytes, bool] = LRUCache(maxsize=max_entries)
        self._lookups: dict[bytes, asyncio.Task[Principal | None]] = {}

    def cached(self, secret: str) -> Principal | None:
        """The principal of a secret found recently and not expired since; None otherwise (no lookup)."""
        return self._cached(secret_hash(secret))

    def known_good(self, secret: str) -> bool:
        """Whether `secret` was found valid before (whatever it is now; no lookup)."""
        return secret_hash(secret) in self.known

    async def principal(self, secret: str) -> Principal | None:
        if not well_formed(secret):
            return None
        digest = secret_hash(secret)
        found = self._cached(digest)
        if found is not None or digest in self.unknown:
            return found
        lookup = self._lookups.get(digest)
        if lookup is None:
            lookup = asyncio.get_running_loop().create_task(self._lookup(digest), name="api-token-lookup")
            self._lookups[digest] = lookup
            lookup.add_done_callback(functools.partial(self._looked_up, digest))
        # Shielded: a caller that goes away does not cancel the lookup the others wait on.
        return await asyncio.shield(lookup)

    def _cached(self, digest: bytes) -> Principal | None:
        hit = self.found.get(digest)
        if hit is None:
            return None
        principal, expires_at = hit
        if expires_at is not None and expires_at <= datetime.now(UTC):
            del self.found[digest]
            return None
        return principal

    async def _lookup(self, digest: bytes) -> Principal | None:
        row = await self.pool.fetchrow(sql("api_token_by_hash"), digest)
        if row is None:
            self.unknown[digest] = True
            return None
        found = Principal.of(f"token:{row['name']}", row["roles"], namespaces=row["namespaces"], tenants=row["tenants"])
        self.found[digest] = (found, row["expires_at"])
        self.known[digest] = True
        return found

    def _looked_up(self, digest: bytes, lookup: asyncio.Task[Principal | None]) -> None:
        self._lookups.pop(digest, None)
        if not lookup.cancelled():
            # Marks a failure as seen: the waiters were given it, and if they all went away nobody needs it.
            lookup.exception()
