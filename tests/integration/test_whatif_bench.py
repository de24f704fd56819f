"""`budgetgate bench what-if` end to end with a small history: it replays every recorded
decision, finds the flips a tighter candidate must cause, and leaves no database behind.
No timing is asserted: the figure belongs to the benchmark (see bench/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import asyncpg


async def test_bench_what_if_replays_the_whole_history(postgres_admin_dsn: str) -> None:
    env = {**os.environ, "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn}
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "what-if", "--decisions", "3000", "--teams", "20", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["decisions"] == 3000
    # Every limit at 70 %: some recorded ALLOWs cannot all fit any more.
    assert 0 < report["flips"] <= report["recorded_allows"] < 3000
    assert report["not_simulated"] == 0  # budgets decided every one of them
    # Its CPU per decision replayed: this process and the database's server processes, both
    # read on this machine (a replay of 3,000 decisions takes more than a clock tick of each).
    cpu = report["cpu"]
    assert list(cpu["us_per_unit"]) == ["budgetgate", "postgres"]
    assert cpu["us_per_unit"]["budgetgate"] > 0 and cpu["us_per_unit"]["postgres"] is not None
    assert cpu["all_parts_us_per_unit"] > 0
    conn = await asyncpg.connect(postgres_admin_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname LIKE 'bench_whatif_%'") == 0
    finally:
        await conn.close()
