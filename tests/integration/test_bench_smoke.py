"""`budgetgate bench admission` end to end with tiny numbers: both systems run, the report says
so, the over-admission check passes, and nothing the benchmark created is left behind.
No timing is asserted: wall-clock figures belong to the benchmark, not to the test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import asyncpg
import pytest
import redis


async def test_bench_reports_both_systems_and_passes_its_check(postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> None:
    env = {
        **os.environ,
        "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn,
        "BUDGETGATE_REDIS_URL": redis_server_url,
        "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap,
    }
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "admission", "--requests", "60", "--concurrency", "4",
               "--warmup", "10", "--scenario", "hot", "--open-loop-rate", "40", "--open-loop-seconds", "1", "--rounds", "2", "--json"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr

    report = json.loads(done.stdout)
    # Two rounds, the systems taking turns to go first.
    assert [(r["round"], r["system"]) for r in report["results"]] == [(1, "baseline"), (1, "budgetgate"), (2, "budgetgate"), (2, "baseline")]
    assert report["correct"] is True
    for result in report["results"]:
        assert result["scenario"] == "hot" and result["requests"] == 60
        assert result["errors"] == 0, result["error_kinds"]
        assert result["correctness"]["problems"] == []
        # 10 warm-up + 48 of the 60 measured submissions fit, at 8 GPU-hours each.
        assert result["allowed"] == result["expected_allowed"] == 48
        assert result["correctness"]["admitted_gpu_hours"] <= result["correctness"]["limit_gpu_hours"] == 58 * 8
        # What each part spent per decision: the service and the load generator are processes of
        # this machine, so known; the broker was given, not started here, so unknown.
        spent = result["cpu"]["us_per_unit"]
        parts = ["service", "postgres", "redis", "broker", "load generator"] if result["system"] == "budgetgate" else ["service", "postgres", "load generator"]
        assert list(spent) == parts
        assert spent["service"] is not None and spent["service"] >= 0 and spent["load generator"] is not None
        assert spent.get("broker", None) is None
        # The CPU bound adds every part: none with the broker unknown; else all CPUs at that cost.
        cpu = result["cpu"]
        if None in cpu["cpu_seconds"].values():
            assert cpu["bound_per_second"] is None
        else:
            # (cpu_seconds are rounded to the millisecond in the report)
            assert cpu["bound_per_second"] == pytest.approx(cpu["cpus"] * result["answered"] / sum(cpu["cpu_seconds"].values()), rel=0.1)
        # The garbage collector's figures come from budgetgate's /metrics; the baseline has none.
        collected = result["garbage_collection"]
        if result["system"] == "budgetgate":
            assert set(collected["passes"]) == {"young", "middle", "full"} and collected["cpu_seconds"] > 0
            assert 0 <= collected["share"] < 1
        else:
            assert collected is None
    assert [(r["round"], r["scenario"]) for r in report["ratios"]] == [(1, "hot"), (2, "hot")]
    [median] = report["medians"]
    assert median["scenario"] == "hot" and median["throughput"]["rounds"] == median["ceiling"]["rounds"] == 2
    assert median["throughput"]["low"] <= median["throughput"]["median"] <= median["throughput"]["high"]
    assert [c["round"] for c in report["fastapi_ceilings"]] == [1, 2]
    assert report["fastapi_ceiling"]["requests_per_second"] == max(c["requests_per_second"] for c in report["fastapi_ceilings"])
    ceiling = report["fastapi_ceiling"]
    assert ceiling["errors"] == 0 and ceiling["requests_per_second"] > 0 and set(ceiling["budgetgate"]) == {"hot"}
    assert list(ceiling["cpu"]["us_per_unit"]) == ["service", "load generator"] and ceiling["cpu"]["us_per_unit"]["service"] is not None
    opened = {r["system"]: r for r in report["open_loop"]}
    assert set(opened) == {"budgetgate", "baseline"}
    for result in opened.values():
        assert result["requests"] == 40 and result["errors"] == 0 and result["correct"] is True
        assert result["p50_ms"] <= result["p99_ms"] <= result["p999_ms"]
        windows = list(zip(result["p50_ms_by_window"], result["p99_ms_by_window"], strict=True))
        assert windows and all(p50 <= p99 <= result["p999_ms"] for p50, p99 in windows)

    tag = report["run_tag"]
    conn = await asyncpg.connect(postgres_admin_dsn)
    try:
        left = await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname LIKE $1", f"bench\\_{tag}\\_%")
    finally:
        await conn.close()
    assert left == 0
    client = redis.Redis.from_url(redis_server_url)
    try:
        assert list(client.scan_iter(match=f"{{bench-{tag}-*", count=1000)) == []
    finally:
        client.close()
