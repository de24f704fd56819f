"""What waking an idle peer costs on this machine, for reading `bench admission`'s open loop.

A round trip to Redis and to Postgres is timed twice in a row after the prober slept `idle`
seconds: the first finds the peer (and, on a virtual machine whose idle CPUs halt, its CPU)
asleep; the second finds it awake. At 200 submissions/s a lone decision finds its peers asleep.
Before its answer budgetgate's makes two Redis round trips (the caller's rate limit, the
reservation) and two Postgres statements (the batch's read, its write) with its own work between
them; the baseline's makes six statements back to back on one connection (whether its backend
sleeps between them is not measured here). The difference of the two times, times the peers a
decision wakes, bounds what waking adds to its latency; the rest is CPU (on December 2, 2026 about
0.5 ms of a 2.2-2.4 ms gap to the baseline's p50: docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

from budgetgate.runtime import redis_client


@dataclass(frozen=True)
class WakeUps:
    """Median milliseconds of a round trip after `idle_ms` asleep (`*_idle_ms`) and right after
    another (`*_busy_ms`), over `rounds` pairs."""

    idle_ms: float
    rounds: int
    redis_idle_ms: float
    redis_busy_ms: float
    postgres_idle_ms: float
    postgres_busy_ms: float

    def line(self) -> str:
        return (
            f"idle peers on this machine (median of {self.rounds}): a round trip after {self.idle_ms:g} ms asleep, against one right after "
            f"another: Redis {self.redis_idle_ms:.2f} vs {self.redis_busy_ms:.2f} ms, Postgres {self.postgres_idle_ms:.2f} vs "
            f"{self.postgres_busy_ms:.2f} ms (before its answer a lone budgetgate decision makes 2 Redis round trips and 2 Postgres "
            "statements apart, the baseline's 6 statements back to back)"
        )


async def measure(redis_url: str, postgres_dsn: str, *, idle: float = 0.005, rounds: int = 100) -> WakeUps:
    """Time `rounds` pairs of round trips to each peer (PING, `SELECT 1`), each pair after
    sleeping `idle` seconds."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    redis = redis_client.connect(redis_url)
    conn = await asyncpg.connect(postgres_dsn)
    try:

        async def postgres() -> None:
            await conn.fetchval("SELECT 1")

        await redis.ping()
        await postgres()  # connected, and each call's first use over
        redis_pairs = await _pairs(redis.ping, idle=idle, rounds=rounds)
        postgres_pairs = await _pairs(postgres, idle=idle, rounds=rounds)
    finally:
        await conn.close()
        await redis.aclose()
    return WakeUps(idle * 1000, rounds, *redis_pairs, *postgres_pairs)


async def _pairs(call: Callable[[], Awaitable[object]], *, idle: float, rounds: int) -> tuple[float, float]:
    """Median ms of the first and of the second of `rounds` pairs of `call`, each after `idle` s."""
    first, second = [], []
    for _ in range(rounds):
        await asyncio.sleep(idle)
        started = time.perf_counter()
        await call()
        between = time.perf_counter()
        await call()
        first.append(between - started)
        second.append(time.perf_counter() - between)
    return statistics.median(first) * 1000, statistics.median(second) * 1000
