"""Room for one checkout on shared Postgres, Redis and Kafka servers.

When `dev up` is pointed at servers other checkouts may use too, each checkout gets its own
database, Redis key prefix and topic prefix, all derived from the checkout's path: stable across
restarts of the same checkout, different for two checkouts side by side.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from budgetgate.devstack.ports import port_open, split_host_port


class ExternalServerError(RuntimeError):
    """A server named by a BUDGETGATE_* variable does not answer."""


def checkout_tag(root: Path) -> str:
    """A short name for a checkout, e.g. 'main-3fa2c1d0': its folder name and a hash of its path."""
    resolved = root.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9]+", "-", resolved.name.lower()).strip("-")[:20] or "checkout"
    return f"{base}-{digest}"


def database_name(tag: str) -> str:
    return "bg_" + tag.replace("-", "_")


def redis_prefix(tag: str) -> str:
    return f"bg-{tag}"


def topic_prefix(tag: str) -> str:
    return f"{tag}-"


def with_database(dsn: str, database: str) -> str:
    """The same server and credentials as `dsn`, another database."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ExternalServerError(f"expected a postgresql:// URL, got {dsn!r}")
    return urlunsplit(parts._replace(path=f"/{database}"))


async def ensure_database(dsn: str, database: str) -> None:
    """Create `database` on the server of `dsn` unless it exists."""
    import asyncpg

    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        raise ExternalServerError(f"Postgres at {redact(dsn)} does not answer: {exc}") from exc
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if not exists:
            try:
                await conn.execute(f'CREATE DATABASE "{database}"')
            except asyncpg.DuplicateDatabaseError:
                pass  # created meanwhile by a concurrent `dev up` or test session
    finally:
        await conn.close()


def check_redis(url: str) -> None:
    """Raise ExternalServerError unless the Redis at `url` (a server, or a cluster by one of its
    nodes) answers PING."""
    import redis

    from budgetgate.runtime.redis_client import connect_sync

    try:
        client = connect_sync(url, socket_connect_timeout=3, socket_timeout=3)
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:  # a cluster's client finds its nodes at once
        raise ExternalServerError(f"Redis at {redact(url)} does not answer: {exc}") from exc
    try:
        client.ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise ExternalServerError(f"Redis at {redact(url)} does not answer: {exc}") from exc
    finally:
        client.close()


def check_kafka(bootstrap: str) -> None:
    """Raise ExternalServerError unless some broker of `bootstrap` accepts TCP connections."""
    addresses = [split_host_port(a, 9092) for a in bootstrap.split(",") if a.strip()]
    if not any(port_open(host, port, timeout=3) for host, port in addresses):
        raise ExternalServerError(f"no Kafka broker of {bootstrap!r} accepts connections")


def redact(url: str) -> str:
    """An address without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))
