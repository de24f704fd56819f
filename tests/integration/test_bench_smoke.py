"""`budgetgate bench admission` end to end with tiny numbers: both systems run, the report says
so, the over-admission check passes, and nothing the benchmark created is left behind; then
`budgetgate bench capacity` on that very report and a tiny `bench metering` run, its plan's
arithmetic checked against the reports' own figures. No timing is asserted: wall-clock figures
belong to the benchmark, not to the test run."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from budgetgate.benchmark import capacity
from budgetgate.benchmark.systems import drop_prefixed_keys
from budgetgate.runtime.redis_client import connect_sync
from budgetgate.devstack.redis_cluster import EmbeddedRedisCluster
from budgetgate.services.admission.stages import STAGES
from tests.support.bench import assert_nothing_left, bench_env, bench_json


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory: pytest.TempPathFactory, postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> Path:
    """The JSON report of two rounds of both systems, hot, closed and open loop (run once for the
    tests of this file)."""
    env = bench_env(postgres_admin_dsn, redis_server_url, kafka_server_bootstrap)
    report = tmp_path_factory.mktemp("bench") / "admission.json"
    report.write_text(bench_json(["admission", "--requests", "60", "--concurrency", "4", "--warmup", "10", "--scenario", "hot",
                              "--open-loop-rate", "40", "--open-loop-seconds", "1", "--rounds", "2", "--json"], env))  # fmt: skip
    return report


async def test_bench_reports_both_systems_and_passes_its_check(two_rounds: Path, postgres_admin_dsn: str, redis_server_url: str) -> None:
    report = json.loads(two_rounds.read_text())
    # With an open loop, what waking an idle Redis and Postgres costs here, timed once.
    wake = report["wake_ups"]
    assert wake["rounds"] == 100 and wake["idle_ms"] == 5
    assert all(wake[f"{peer}_{when}_ms"] > 0 for peer in ("redis", "postgres") for when in ("idle", "busy"))
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
        # All parts add every part but the load generator, shown beside them: none with the broker
        # unknown; the CPU bound is all CPUs at that cost.
        cpu = result["cpu"]
        assert cpu["not_in_all_parts"] == ["load generator"]
        assert cpu["bound_by_waiting"] == (cpu["machine_busy"] < 0.9)
        counted = [seconds for part, seconds in cpu["cpu_seconds"].items() if part != "load generator"]
        if None in counted:
            assert cpu["bound_per_second"] is None and cpu["all_parts_us_per_unit"] is None
        else:
            # (cpu_seconds are rounded to the millisecond in the report)
            assert cpu["all_parts_us_per_unit"] == pytest.approx(sum(counted) / result["answered"] * 1e6, rel=0.1, abs=20)
            assert cpu["bound_per_second"] == pytest.approx(cpu["cpus"] * result["answered"] / sum(counted), rel=0.1)
        # Where budgetgate's measured submissions spent their time, stage by stage; the baseline has no stages.
        if result["system"] == "budgetgate":
            assert list(result["stages"]) == list(STAGES) and all(stage["count"] > 0 for stage in result["stages"].values())
        else:
            assert result["stages"] is None
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
    # The open loop in every round, for each system; budgetgate against the baseline's of its round.
    assert sorted((r["round"], r["system"], r["scenario"]) for r in report["open_loop"]) == [
        (1, "baseline", "hot"), (1, "budgetgate", "hot"), (2, "baseline", "hot"), (2, "budgetgate", "hot")
    ]  # fmt: skip
    [opened] = report["open_loop_medians"]
    assert opened["scenario"] == "hot" and opened["p99_vs_baseline"]["rounds"] == 2
    assert {m["system"] for m in report["cpu_medians"]} == {"budgetgate", "baseline"}
    for result in report["open_loop"]:
        assert result["requests"] == 40 and result["errors"] == 0 and result["correct"] is True
        assert result["cpu"] is not None and (result["stages"] is not None) == (result["system"] == "budgetgate")
        assert result["p50_ms"] <= result["p99_ms"] <= result["p999_ms"]
        windows = list(zip(result["p50_ms_by_window"], result["p99_ms_by_window"], strict=True))
        assert windows and all(p50 <= p99 <= result["p999_ms"] for p50, p99 in windows)

    await assert_nothing_left(postgres_admin_dsn, report["run_tag"], redis_url=redis_server_url)


async def test_replicas_are_driven_as_one_service_and_audited_together(postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str) -> None:
    """`--replicas 2`: two processes of each system (and of the ceiling) on one database and one
    Redis; both answer, the audit of the one ledger passes, and the CPU figures name each replica
    beside their sum, which all parts count once."""
    env = bench_env(postgres_admin_dsn, redis_server_url, kafka_server_bootstrap)
    report = json.loads(bench_json(["admission", "--requests", "60", "--concurrency", "4", "--warmup", "10", "--scenario", "hot",
                                "--open-loop-rate", "40", "--open-loop-seconds", "1", "--replicas", "2", "--json"], env))  # fmt: skip
    assert report["correct"] is True and report["options"]["replicas"] == 2
    for result in [*report["results"], *report["open_loop"]]:
        assert result["errors"] == 0 and result["correct"] is True, result
        answered = result["answered_by_replica"]
        assert list(answered) == ["service 1", "service 2"] and all(count > 0 for count in answered.values())
        cpu = result["cpu"]
        others = ["postgres", "redis", "broker"] if result["system"] == "budgetgate" else ["postgres"]
        assert list(cpu["us_per_unit"]) == ["service 1", "service 2", *others, "load generator"]
        assert cpu["groups"] == {"service": ["service 1", "service 2"]}
        assert cpu["us_per_unit"]["service 1"] is not None and cpu["us_per_unit"]["service 2"] is not None
        assert cpu["group_us_per_unit"]["service"] == pytest.approx(cpu["us_per_unit"]["service 1"] + cpu["us_per_unit"]["service 2"], abs=0.2)
        counted = [seconds for part, seconds in cpu["cpu_seconds"].items() if part != "load generator"]
        if None not in counted:
            assert cpu["all_parts_us_per_unit"] == pytest.approx(sum(counted) / sum(answered.values()) * 1e6, rel=0.1, abs=20)
        # The stages of every measured submission whichever replica answered it, and the
        # garbage collection of both processes, added up.
        if result["system"] == "budgetgate":
            assert list(result["stages"]) == list(STAGES) and all(stage["count"] > 0 for stage in result["stages"].values())
    for result in report["results"]:
        assert result["allowed"] == result["expected_allowed"] == 48 and result["correctness"]["problems"] == []
        if result["system"] == "budgetgate":
            assert result["garbage_collection"]["replicas"] == 2
    # The open loop goes round robin: 40 submissions, 20 to each.
    assert {tuple(r["answered_by_replica"].values()) for r in report["open_loop"]} == {(20, 20)}
    assert list(report["fastapi_ceiling"]["cpu"]["us_per_unit"]) == ["service 1", "service 2", "load generator"]
    assert {(m["system"], tuple(m["groups"]["service"])) for m in report["run_medians"]} == {
        ("baseline", ("service 1", "service 2")), ("budgetgate", ("service 1", "service 2"))
    }  # fmt: skip
    await assert_nothing_left(postgres_admin_dsn, report["run_tag"], redis_url=redis_server_url)


async def test_a_redis_cluster_is_benchmarked_node_by_node_and_audited(tmp_path: Path, postgres_admin_dsn: str, kafka_server_bootstrap: str) -> None:
    """`BUDGETGATE_REDIS_URL=redis+cluster://…` with `--replicas 2` and `--ledger-shards 3`: the
    two replicas of budgetgate reserve on a Redis Cluster, each team on its shard, the audit reads
    the ledger back from every shard, each node's CPU is a part of its own (`redis-<port>`,
    masters and replicas), and the benchmark's keys are gone from the cluster afterwards."""
    with EmbeddedRedisCluster(tmp_path / "cluster") as cluster:
        env = bench_env(postgres_admin_dsn, cluster.url, kafka_server_bootstrap)
        report = json.loads(bench_json(["admission", "--system", "budgetgate", "--requests", "60", "--concurrency", "4", "--warmup", "10",
                                    "--scenario", "spread", "--budgets", "6", "--replicas", "2", "--ledger-shards", "3", "--no-ceiling", "--json"],
                                   env))  # fmt: skip
        [result] = report["results"]
        assert report["options"]["ledger_shards"] == 3
        assert report["correct"] is True and result["correct"] is True and result["errors"] == 0
        assert result["allowed"] == result["expected_allowed"] and result["correctness"]["problems"] == []
        nodes = [part for part in result["cpu"]["us_per_unit"] if part.startswith("redis-")]
        assert sorted(nodes) == sorted(f"redis-{node.port}" for node in cluster.nodes) and "redis" not in result["cpu"]["us_per_unit"]
        assert all(result["cpu"]["us_per_unit"][node] is not None for node in nodes)
        assert capacity.admission_cost(report)[0].redis == pytest.approx(sum(result["cpu"]["us_per_unit"][node] for node in nodes), abs=0.5)
        await assert_nothing_left(postgres_admin_dsn, report["run_tag"], redis_url=cluster.url)


async def test_cleanup_of_several_shards_deletes_the_prefix_s_own_tag_too(redis_url: str, redis_prefix: str) -> None:
    """With three shards the services still keep the rate limit's windows under the prefix's own
    tag (`{prefix}:ratelimit…`, gone a second later by their TTL): the cleanup deletes them with
    the shards' keys, and nothing of another prefix."""
    client = connect_sync(redis_url)
    try:
        ours = [f"{{{redis_prefix}}}:ratelimit/LIMITER/bench/1/1/second", f"{{{redis_prefix}:0}}:budget:a", f"{{{redis_prefix}:2}}:run:b"]
        theirs = f"{{{redis_prefix}x}}:budget:c"
        for key in [*ours, theirs]:
            client.set(key, 1)
        await drop_prefixed_keys(redis_url, redis_prefix, shards=3)
        assert [key for key in [*ours, theirs] if client.exists(key)] == [theirs]
    finally:
        client.close()


def test_capacity_plans_from_the_benchmarks_own_reports(
    two_rounds: Path, tmp_path: Path, postgres_admin_dsn: str, redis_server_url: str, kafka_server_bootstrap: str
) -> None:
    """`bench capacity` on the two rounds above and a tiny `bench metering` run: what the plan
    says each service costs is the reports' own CPU per unit times the rate it assumes."""
    env = bench_env(postgres_admin_dsn, redis_server_url, kafka_server_bootstrap)
    metering = tmp_path / "metering.json"
    metering.write_text(bench_json(["metering", "--samples", "12000", "--runs", "20", "--json"], env))
    metering_report = json.loads(metering.read_text())
    capacity = ["capacity", "--admission", str(two_rounds), "--scenario", "hot", "--metering", str(metering)]
    if metering_report["cpu"] is None:
        # One poll took every sample: no window to measure in (the metering bench says so).
        refused = subprocess.run(
            [sys.executable, "-m", "budgetgate.cli.main", "bench", *capacity], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert refused.returncode != 0 and "no CPU figures" in refused.stderr
        return
    planned = json.loads(bench_json([*capacity, "--gpus", "1000,2000", "--json"], env, timeout=60))
    report = json.loads(two_rounds.read_text())

    def service_us(rows: list[dict[str, Any]]) -> float:
        return statistics.median(r["cpu"]["us_per_unit"]["service"] for r in rows if r["system"] == "budgetgate")

    decision_service = max(service_us(report["results"]), service_us(report["open_loop"]))
    first, second = planned["plans"]
    # 1,000 GPUs: 2 requests/s at the assumed peak, each costing the dearer loop's service CPU.
    assert first["decisions_per_s"] == 2.0
    assert abs(first["admission"]["cores_busy"] - 2.0 * decision_service / 1e6) < 1e-9
    # (the plan's rates are rounded to the thousandth)
    assert first["metering"]["cores_busy"] == pytest.approx(first["samples_per_s"] * metering_report["cpu"]["us_per_unit"]["service"] / 1e6, rel=1e-3)
    assert abs(second["admission"]["cores_busy"] - 2 * first["admission"]["cores_busy"]) < 1e-9
    # The broker was given, not started by the benchmarks: its cost is unknown, and so is any
    # plan for it; the reconciliation report was not given, so the stores' figures are partial.
    assert first["broker"] == {"cores_busy": None, "units": None}
    assert first["complete"] is False and first["reconciler"]["cores_busy"] is None
