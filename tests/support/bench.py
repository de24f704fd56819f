"""What the benchmark tests check once a `budgetgate bench …` run is over."""

from __future__ import annotations

import asyncpg

from budgetgate.runtime.redis_client import connect_sync


async def assert_nothing_left(admin_dsn: str, tag: str, *, redis_url: str | None = None) -> None:
    """No database of run `tag` is left (bench_<tag>_…), and with `redis_url` no Redis key under
    its prefixes ({bench-<tag>…})."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        left = await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname LIKE $1", f"bench\\_{tag}\\_%")
    finally:
        await conn.close()
    assert left == 0
    if redis_url is None:
        return
    client = connect_sync(redis_url)
    try:
        assert list(client.scan_iter(match=f"{{bench-{tag}*", count=1000)) == []
    finally:
        client.close()
