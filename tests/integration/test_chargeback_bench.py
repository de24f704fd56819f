"""`budgetgate bench report` end to end with a small month: every grouping totals the GPU-hours
it loaded, the plan is printed, and no database is left behind. No timing is asserted: the
figure belongs to the benchmark (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import asyncpg


async def test_bench_report_totals_what_it_loaded(postgres_admin_dsn: str) -> None:
    env = {**os.environ, "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn}
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "report", "--records", "4000", "--runs", "200", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["records"] == 4000 and report["runs"] == 200
    # Run i uses 1 + i % 8 GPUs; each of its 20 samples adds seven minutes of them (420,000 each).
    assert report["gpu_milli_hours"] == sum(1 + i % 8 for i in range(200)) * 20 * 420_000
    assert report["rows"]["tenant"] == 50 and report["rows"]["user by month"] == 200
    assert any("usage_records" in line for line in report["plan"]) and report["plan"][-1].startswith("Execution Time")
    # The CPU of its five reports (one round of five groupings), per usage record per report.
    assert report["reports"] == 5
    assert list(report["cpu"]["us_per_unit"]) == ["budgetgate", "postgres"] and report["cpu"]["all_parts_us_per_unit"] > 0
    conn = await asyncpg.connect(postgres_admin_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname LIKE 'bench_report_%'") == 0
    finally:
        await conn.close()
