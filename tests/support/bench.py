"""What the benchmark tests check once a `budgetgate bench …` run is over."""

from __future__ import annotations

import os
import subprocess
import sys

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


def bench_env(postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> dict[str, str]:
    """The environment `budgetgate bench` runs in against the tests' servers."""
    return {
        **os.environ,
        "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn,
        "BUDGETGATE_REDIS_URL": redis_server_url,
        "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap,
    }


def bench_json(args: list[str], env: dict[str, str], *, timeout: float = 240) -> str:
    """`budgetgate bench ARGS` run to completion (it must succeed): what it printed."""
    done = subprocess.run([sys.executable, "-m", "budgetgate.cli.main", "bench", *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout
