"""`budgetgate bench metering-statement` with tiny numbers: metering_place_batch placed poll by poll
on a database of its own, the usage checked against the clean stream's, Postgres's CPU read
(and the benchmark's own, apart), one poll's plans printed, and the database dropped. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import asyncpg

from budgetgate.benchmark import metering_workload
from budgetgate.benchmark.metering_runner import check_usage
from budgetgate.core.metering import Counters
from tests.support.bench import bench_json


async def test_the_statement_alone_places_the_load_correctly_and_says_what_it_cost(postgres_admin_dsn: str) -> None:
    env = {"BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn}
    args = ["metering-statement", "--samples", "3000", "--runs", "30", "--poll", "1000", "--rounds", "2", "--explain", "--json"]
    report = json.loads(bench_json(args, {**os.environ, **env}))
    assert report["correct"] is True
    assert len(report["rounds"]) == 2
    for round_ in report["rounds"]:
        # 3,000 samples and a resend after every tenth: 3,300 in polls of 1,000, the last (300)
        # placed under auto_explain and left out of the figures.
        assert (round_["samples"], round_["polls"], round_["left_to_core"], round_["problems"]) == (3000, 3, 0, [])
        assert 0 < round_["usage_rows"] <= 3000
        spent = round_["cpu"]["cpu_seconds"]
        assert spent["postgres"] > 0 and spent["load generator"] > 0
        assert round_["cpu"]["not_in_all_parts"] == ["load generator"]
    plans = "\n".join(report["rounds"][0]["plans"])
    assert "INSERT INTO usage_records" in plans and "actual time=" in plans
    assert report["rounds"][1]["plans"]  # every round explains its last poll
    assert report["median_cpu_us_per_sample"]["postgres"]["rounds"] == report["samples_per_s"]["rounds"] == 2
    conn = await asyncpg.connect(postgres_admin_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pg_database WHERE datname LIKE 'bench\\_%\\_statement\\_%'") == 0
    finally:
        await conn.close()


async def test_the_check_names_what_the_usage_recorded_gets_wrong(pg_dsn: str) -> None:
    """The check the report rests on (bench metering's): a run whose usage was never recorded, or
    recorded off the clean stream, is named."""
    work = metering_workload.build(samples=6, runs=2, resend_every=0, tag="check")
    first, second = work.runs
    conn = await asyncpg.connect(pg_dsn)
    try:
        expected = work.expected[first]
        await conn.execute(
            "INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, node_milli_hours_cumulative, samples) VALUES ($1, $2, $3, 3)",
            first, expected.gpu, expected.node - 1,
        )  # fmt: skip
    finally:
        await conn.close()
    problems = await check_usage(pg_dsn, work, [])
    assert f"run {first}: cumulative {Counters(expected.gpu, expected.node - 1)}, expected {expected}" in problems
    assert f"run {second}: cumulative None, expected {work.expected[second]}" in problems
    assert f"run {second}: 0 samples applied, 3 distinct" in problems


def test_explain_refuses_a_load_of_one_poll(postgres_admin_dsn: str) -> None:
    args = ["bench", "metering-statement", "--samples", "100", "--runs", "10", "--explain"]
    env = {**os.environ, "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn}
    done = subprocess.run([sys.executable, "-m", "budgetgate.cli.main", *args], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "--explain needs a load of two polls or more (this one is 110 samples, polls of 15000)" in done.stderr
