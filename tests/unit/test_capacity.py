"""The capacity model (budgetgate.benchmark.capacity) and `budgetgate bench capacity`: how the
benchmarks' figures are read, and what bad reports get."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from budgetgate.benchmark import capacity
from budgetgate.benchmark.capacity import Costs, CostsMissing, Load, UnitCost
from budgetgate.cli.bench import bench


def run(system: str, scenario: str, parts: dict[str, float | None]) -> dict[str, Any]:
    return {"system": system, "scenario": scenario, "cpu": {"us_per_unit": parts}}


ADMISSION = {
    "results": [
        run("baseline", "spread", {"service": 1275.0, "postgres": 725.0, "load generator": 250.0}),
        run("budgetgate", "spread", {"service": 900.0, "postgres": 500.0, "redis": 80.0, "broker": 10.0, "load generator": 200.0}),
        run("budgetgate", "spread", {"service": 1000.0, "postgres": 600.0, "redis": 60.0, "broker": 20.0, "load generator": 200.0}),
        run("budgetgate", "hot", {"service": 1.0, "postgres": 1.0, "redis": 1.0, "broker": 1.0}),
    ],
    "open_loop": [run("budgetgate", "spread", {"service": 2000.0, "postgres": 400.0, "redis": 50.0, "broker": 5.0})],
}
METERING = {"cpu": {"us_per_unit": {"service": 42.0, "postgres": 29.0, "broker": 3.0}}}


def test_parts_are_grouped_replicas_and_redis_nodes_added_and_the_load_generator_left_out() -> None:
    cost = capacity.unit_cost({"admission-1": 500.0, "admission-2": 450.0, "postgres": 300.0, "redis-7001": 20.0, "redis-7002": 30.0, "load generator": 99.0})
    assert cost == UnitCost(service=950.0, postgres=300.0, redis=50.0, broker=0.0)  # no broker metered: none used
    # A part metered but not read is unknown, and so is any sum it is in.
    assert capacity.unit_cost({"service": 1.0, "postgres": None, "redis-1": 2.0, "redis-2": None, "broker": None}) == UnitCost(1.0, None, None, None)


def test_admission_costs_the_dearer_of_its_closed_and_open_loops_per_part_in_the_scenario() -> None:
    cost, source = capacity.admission_cost(ADMISSION)
    # Closed loop medians: service 950, postgres 550, redis 70, broker 15; open loop: 2000, 400, 50, 5.
    assert cost == UnitCost(service=2000.0, postgres=550.0, redis=70.0, broker=15.0)
    assert "closed loop (2 rounds) and open loop (1 rounds), spread" in source
    only_closed = {"results": ADMISSION["results"]}
    assert capacity.admission_cost(only_closed)[0] == UnitCost(950.0, 550.0, 70.0, 15.0)
    with pytest.raises(CostsMissing, match="no CPU figures of budgetgate in scenario 'spread'"):
        capacity.admission_cost({"results": [ADMISSION["results"][0]]})
    with pytest.raises(CostsMissing, match="not a `budgetgate bench admission --json` report"):
        capacity.admission_cost(METERING)


def test_metering_costs_are_the_median_of_its_rounds_and_a_report_without_cpu_is_refused() -> None:
    rounds = {"rounds": [{"cpu": {"us_per_unit": {"service": v, "postgres": 10.0, "broker": 1.0}}} for v in (40.0, 60.0, 50.0)] + [{"cpu": None}]}
    assert capacity.metering_cost(rounds)[0] == UnitCost(50.0, 10.0, 0.0, 1.0)
    with pytest.raises(CostsMissing, match="no CPU figures"):
        capacity.metering_cost({"cpu": None})


def test_a_plan_from_known_costs_by_hand() -> None:
    costs = capacity.costs(ADMISSION, METERING)
    plan = capacity.plan(10_000, costs, Load())
    # 10,000 GPUs at 85 %, 8 a run: 1,062.5 runs; 20 requests/s; a sample per run every 15 s.
    assert plan.running_runs == 1062.5 and plan.decisions_per_s == 20.0 and plan.samples_per_s == pytest.approx(70.833, abs=1e-3)
    assert plan.admission.cores_busy == pytest.approx(20 * 2000 / 1e6)
    assert plan.postgres.cores_busy == pytest.approx((20 * 550 + 1062.5 / 15 * 29) / 1e6)
    assert plan.redis.cores_busy == pytest.approx(20 * 70 / 1e6)
    assert plan.admission.units == 2 and plan.redis.units == 1  # the minimums
    assert plan.reconciler == capacity.Need(None, None) and not plan.complete
    text = capacity.as_markdown([plan], costs, Load())
    assert "| Postgres: cores busy | ≥ " in text and "| reconciler: replicas | not measured |" in text
    assert "reconciliation: not measured" in text


def test_a_bad_load_is_refused() -> None:
    for bad in ({"utilization": 0.0}, {"headroom": 1.5}, {"sample_seconds": 0.0}, {"min_replicas": 0}):
        with pytest.raises(ValueError):
            Load(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpus must be positive"):
        capacity.plan(0, Costs(UnitCost(), UnitCost()))


def test_the_command_names_what_is_wrong_with_its_files(tmp_path: Path) -> None:
    admission, metering = tmp_path / "a.json", tmp_path / "m.json"
    admission.write_text(json.dumps(ADMISSION))
    metering.write_text(json.dumps(METERING))
    runner = CliRunner()
    good = runner.invoke(bench, ["capacity", "--admission", str(admission), "--metering", str(metering), "--gpus", "1000,100_000"])
    assert good.exit_code == 0, good.output
    assert "| | 1,000 GPUs | 100,000 GPUs |" in good.output
    as_json = json.loads(runner.invoke(bench, ["capacity", "--admission", str(admission), "--metering", str(metering), "--gpus", "500", "--json"]).output)
    assert as_json["plans"][0]["gpus"] == 500 and as_json["costs"]["decision"]["service"] == 2000.0
    assert as_json["costs"]["record"] is None and as_json["costs"]["sources"][-1] == "reconciliation: not measured"
    (tmp_path / "bad.json").write_text("{not json")
    cases = {
        ("--admission", str(tmp_path / "missing.json")): "cannot read",
        ("--admission", str(tmp_path / "bad.json")): "is not JSON",
        ("--metering", str(admission)): "no CPU figures",
        ("--gpus", "ten"): "give whole numbers of GPUs",
        ("--gpus", "0"): "give positive numbers of GPUs",
    }
    for (flag, value), message in cases.items():
        args = {"--admission": str(admission), "--metering": str(metering), flag: value}
        outcome = runner.invoke(bench, ["capacity", *[x for pair in args.items() for x in pair]])
        assert outcome.exit_code != 0 and message in outcome.output, (flag, value, outcome.output)


def test_reconciliation_costs_are_per_usage_record_and_the_replicas_are_added_up() -> None:
    steady = {"cpu": {"unit": "usage record", "us_per_unit": {"reconciler 1": 360.0, "reconciler 2": 220.0, "postgres": 465.0, "redis": 40.0, "broker": 9.0}}}
    assert capacity.reconciliation_cost(steady)[0] == UnitCost(580.0, 465.0, 40.0, 9.0)
    per_message = {"cpu": {"unit": "message", "us_per_unit": {"reconciler": 1511.0, "postgres": 1247.0}}}
    with pytest.raises(CostsMissing, match="per message: run `budgetgate bench reconciliation --records-per-s N --json`"):
        capacity.reconciliation_cost(per_message)
    costs = capacity.costs(ADMISSION, METERING, steady)
    plan = capacity.plan(10_000, costs, Load())
    assert plan.complete and plan.reconciler.cores_busy == pytest.approx(plan.records_per_s * 580.0 / 1e6, rel=1e-4)
    assert plan.redis.cores_busy == pytest.approx((plan.decisions_per_s * 70 + plan.records_per_s * 40) / 1e6, rel=1e-4)


def with_writes(row: dict[str, Any], wal: float | None, stored: float | None) -> dict[str, Any]:
    return {**row, "cpu": {**row["cpu"], "postgres_bytes_per_unit": {"wal": wal, "stored": stored}}}


def test_postgres_bytes_per_unit_become_its_wal_rate_and_the_storage_its_retention_holds() -> None:
    closed = [with_writes(r, w, s) for r, (w, s) in zip(ADMISSION["results"], ((9.0, 9.0), (4000.0, 1000.0), (6000.0, 3000.0), (1.0, 1.0)), strict=True)]
    admission = {"results": closed, "open_loop": [with_writes(ADMISSION["open_loop"][0], 7000.0, 1500.0)]}
    metering = {"rounds": [with_writes(METERING, w, s) for w, s in ((300.0, 100.0), (500.0, 300.0), (400.0, 200.0))]}
    written = {"wal": 900.0, "stored": 250.0}
    record = {"cpu": {"unit": "usage record", "us_per_unit": {"reconciler": 500.0, "postgres": 400.0}, "postgres_bytes_per_unit": written}}
    costs = capacity.costs(admission, metering, record)
    # Per decision the dearer of the closed loop's medians (5000, 2000) and the open loop's (7000, 1500).
    assert costs.decision_writes == capacity.WriteCost(wal=7000.0, stored=2000.0)
    assert costs.sample_writes == capacity.WriteCost(wal=400.0, stored=200.0)
    assert costs.record_writes == capacity.WriteCost(wal=900.0, stored=250.0)
    load = Load(retention_months=6, mean_load=0.25)
    plan = capacity.plan(10_000, costs, load)
    samples = 1062.5 / 15
    assert plan.postgres_wal_bytes_per_s == pytest.approx(20 * 7000 + samples * 400 + samples * 900, abs=0.1)
    per_day = (20 * 2000 + samples * 200 + samples * 250) * 86_400
    assert plan.postgres_stored_bytes_per_day == pytest.approx(per_day, abs=1)
    assert plan.postgres_stored_bytes_retained == pytest.approx(per_day * 365.25 / 12 * 6 * 0.25, abs=1)
    text = capacity.as_markdown([plan], costs, load)
    assert f"| Postgres: WAL written at the peak, MB/s | {plan.postgres_wal_bytes_per_s / 1e6:.3f} |" in text
    assert "| Postgres: stored over 6 months at 25% of the peak, GB |" in text
    assert "- decision: service 2000.0, postgres 550.0, redis 70.0, broker 15.0; bytes: WAL 7000, stored 2000" in text


def test_reports_without_postgres_bytes_leave_the_storage_not_measured() -> None:
    costs = capacity.costs(ADMISSION, METERING)
    assert costs.decision_writes == capacity.WriteCost() and costs.record_writes is None
    plan = capacity.plan(1000, costs)
    assert plan.postgres_wal_bytes_per_s is None and plan.postgres_stored_bytes_retained is None
    assert "| Postgres: stored per day at the peak, GB | not measured |" in capacity.as_markdown([plan], costs, Load())
    for bad in ({"retention_months": 0}, {"mean_load": 0.0}, {"mean_load": 1.5}):
        with pytest.raises(ValueError):
            Load(**bad)  # type: ignore[arg-type]
