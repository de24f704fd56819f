"""bench admission's probe of what waking an idle peer costs (budgetgate.benchmark.wakeups)."""

from __future__ import annotations

import asyncio

import pytest

from budgetgate.benchmark import wakeups


async def test_pairs_time_the_first_call_after_sleeping_apart_from_the_second() -> None:
    calls = 0

    async def slow_when_first() -> None:  # stands in for a peer that wakes slowly
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02 if calls % 2 else 0.0)

    first, second = await wakeups._pairs(slow_when_first, idle=0.0, rounds=3)
    assert calls == 6 and first >= 20 and second < 20


def test_the_line_names_both_peers_both_ways() -> None:
    line = wakeups.WakeUps(5, 100, 0.6, 0.18, 0.41, 0.11).line()
    assert "median of 100" in line and "after 5 ms asleep" in line
    assert "Redis 0.60 vs 0.18 ms, Postgres 0.41 vs 0.11 ms" in line


async def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await wakeups.measure("redis://127.0.0.1:1", "postgresql://nobody@127.0.0.1:1/x", rounds=0)
