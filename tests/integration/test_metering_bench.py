"""`budgetgate bench metering` end to end with tiny numbers: both figures are reported, the usage
check passes, and the benchmark's databases are gone afterwards. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.bench import assert_nothing_left


async def test_bench_metering_reports_both_figures_and_passes_its_check(postgres_admin_dsn: str, kafka_server_bootstrap: str) -> None:
    env = {**os.environ, "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn, "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap}
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "metering", "--samples", "120", "--runs", "6", "--resend-every", "4", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr

    report = json.loads(done.stdout)
    assert report["correct"] is True and report["problems"] == []
    assert report["load"] == {"messages": 150, "distinct_samples": 120, "resends": 30, "runs": 6}
    assert report["ingest"]["rows"] == report["copy"]["rows"] == 120
    # Metering as a max-register: a run's samples of a quarter hour in one poll are one row and one
    # usage record (the check above compares the usage up to every quarter hour with the clean stream's).
    assert report["ingest"]["usage_records"] == report["ingest"]["usage_rows"] <= 120
    assert report["ingest"]["rows_per_second"] > 0 and report["copy"]["rows_per_second"] > 0
    assert report["ratio_rows_per_second"] is not None
    # COPY's own CPU, the reference per row: its client (the benchmark's process) and the server
    # process that wrote the rows, both on this machine, so both read (120 rows may take less
    # than the clock tick CPU time is counted in, so zero is possible).
    copy_cpu = report["copy"]["cpu"]
    assert list(copy_cpu["us_per_unit"]) == ["client", "postgres"]
    assert all(spent is not None and spent >= 0 for spent in copy_cpu["us_per_unit"].values())
    assert copy_cpu["all_parts_us_per_unit"] == pytest.approx(sum(copy_cpu["us_per_unit"].values()), abs=0.2)
    # CPU per sample from the service's first commit, per the samples consumed after it (none
    # left when one poll took them all: then no figure rather than a false one). The service is
    # a process of this machine; the broker was given, not started here, so unknown.
    cpu = report["cpu"]
    if cpu is not None:
        assert 0 < cpu["samples"] < 150
        assert list(cpu["us_per_unit"]) == ["service", "postgres", "broker"]
        assert cpu["us_per_unit"]["service"] is not None and cpu["us_per_unit"]["broker"] is None
        assert cpu["bound_per_second"] is None and cpu["bound"] is None  # the broker's cost is unknown
        assert report["cpu_ratio_to_copy"] is None  # nor, so, the service's all parts

    # The service's garbage collection, from its /metrics: the thresholds it runs with leave a
    # load this small nearly uncollected, and what was collected took part of its CPU.
    collected = report["garbage_collection"]
    assert set(collected["passes"]) == {"young", "middle", "full"} and collected["cpu_seconds"] > 0
    assert 0 <= collected["share"] < 1

    await assert_nothing_left(postgres_admin_dsn, report["run_tag"])


async def test_rounds_pair_each_service_run_with_its_own_copy(postgres_admin_dsn: str, kafka_server_bootstrap: str) -> None:
    env = {**os.environ, "BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn, "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap}
    command = [sys.executable, "-m", "budgetgate.cli.main", "bench", "metering", "--samples", "60", "--runs", "3", "--rounds", "2", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "[round 1/2] publishing 66 samples" in done.stderr and "[round 2/2] publishing 66 samples" in done.stderr

    report = json.loads(done.stdout)
    rounds = report["rounds"]
    assert len(rounds) == 2 and report["correct"] is True
    assert len({r["run_tag"] for r in rounds}) == 2  # each round its own databases and topics
    for measured in rounds:
        assert measured["correct"] is True and measured["ingest"]["rows"] == measured["copy"]["rows"] == 60
        assert measured["ratio_rows_per_second"] == round(measured["ingest"]["rows_per_second"] / measured["copy"]["rows_per_second"], 5)
    ratios = sorted(r["ratio_rows_per_second"] for r in rounds)
    assert report["medians"]["ratio_rows_per_second"]["low"] == ratios[0] and report["medians"]["ratio_rows_per_second"]["high"] == ratios[1]
    assert rounds[report["median_round"] - 1]["ratio_rows_per_second"] == ratios[0] == report["ratio_rows_per_second"]
    for measured in rounds:
        await assert_nothing_left(postgres_admin_dsn, measured["run_tag"])
