"""`budgetgate bench admission --rounds N`'s report: each round's budgetgate is held against the
same round's baseline and ceiling, never another round's, and the median of the rounds is the
figure given, with the lowest and highest beside it."""

from __future__ import annotations

import json

import pytest

from budgetgate.benchmark import report, workload
from budgetgate.benchmark.correctness import Audit
from budgetgate.benchmark.cpu import CpuUse
from budgetgate.benchmark.load import Outcome
from budgetgate.benchmark.admission_runner import Measurements, Options, RunResult

REQUESTS = 100


def _outcome(per_second: float, p99_ms: float) -> Outcome:
    """REQUESTS answers over the time `per_second` takes, the slowest 2 % at `p99_ms` (the
    nearest-rank p99 of 100 is the 99th)."""
    latencies = [0.001] * (REQUESTS - 2) + [p99_ms / 1000] * 2
    return Outcome(elapsed=REQUESTS / per_second, latencies=latencies, decisions=["ALLOW"] * REQUESTS)


def _result(system: str, number: int, per_second: float, p99_ms: float, *, service_cpu: float = 0.05, busy: float = 0.5) -> RunResult:
    work = workload.build("hot", requests=REQUESTS, warmup=0, budgets=1, allow_fraction=1.0, tag="t")
    cpu = CpuUse(seconds=1.0, parts={"service": service_cpu, "load generator": 0.01}, machine_busy=busy, cpus=2, apart=frozenset({"load generator"}))
    return RunResult(system, "hot", work, _outcome(per_second, p99_ms), Audit(1, 800.0, 800.0, REQUESTS), {}, cpu, number)


def _measured() -> Measurements:
    # The machine is twice as fast in round 2: every system's figures double, the ratios do not.
    # Round 3 is an outlier for budgetgate.
    results = [
        _result("baseline", 1, 500.0, 40.0),
        _result("budgetgate", 1, 1000.0, 20.0),
        _result("budgetgate", 2, 2000.0, 10.0),
        _result("baseline", 2, 1000.0, 20.0),
        _result("baseline", 3, 500.0, 40.0),
        _result("budgetgate", 3, 400.0, 80.0),
    ]
    cpu = CpuUse(seconds=1.0, parts={"service": 0.02, "load generator": 0.01}, machine_busy=0.5, cpus=2)
    ceilings = {1: (_outcome(4000.0, 5.0), cpu), 2: (_outcome(8000.0, 2.5), cpu), 3: (_outcome(4000.0, 5.0), cpu)}
    return Measurements("t", results, ceilings)


def test_each_round_is_paired_with_its_own_baseline_and_ceiling() -> None:
    measured = _measured()
    assert [(r["round"], r["throughput"], r["p99"]) for r in report.ratios(measured.results)] == [(1, 2.0, 0.5), (2, 2.0, 0.5), (3, 0.8, 2.0)]
    assert [(c["round"], c["budgetgate"]["hot"]) for c in report.ceiling_ratios(measured)] == [(1, 0.25), (2, 0.25), (3, 0.1)]


def test_the_median_of_the_rounds_is_reported_with_its_range() -> None:
    [summary] = report.medians(_measured())
    assert summary["scenario"] == "hot"
    assert summary["throughput"] == {"median": 2.0, "low": 0.8, "high": 2.0, "rounds": 3}
    assert summary["p99"] == {"median": 0.5, "low": 0.5, "high": 2.0, "rounds": 3}
    assert summary["ceiling"] == {"median": 0.25, "low": 0.1, "high": 0.25, "rounds": 3}


def test_the_overall_ceiling_is_the_highest_round_against_budgetgates_median_round() -> None:
    """The ceiling quoted alone is the highest of the rounds (the one that flatters budgetgate
    least), held against budgetgate's median rate."""
    measured = _measured()
    top = report.ceiling(measured)
    assert top is not None
    assert top["requests_per_second"] == pytest.approx(8000.0)
    assert top["budgetgate"]["hot"] == pytest.approx(1000.0 / 8000.0, abs=1e-3)


def test_text_and_json_reports_name_the_rounds() -> None:
    options = Options(requests=REQUESTS, scenarios=("hot",), rounds=3)
    measured = _measured()
    text = report.as_text(options, measured)
    assert "median of 3 rounds, hot: throughput vs baseline 2.00x (0.80x-2.00x), p99 vs baseline 0.50x (0.50x-2.00x)" in text
    assert "budgetgate/baseline, hot #3: throughput 0.80x, p99 latency 2.00x" in text
    assert "fastapi ceiling, round 2: 8000.0 requests/s; budgetgate/ceiling: hot 0.25x" in text
    document = json.loads(json.dumps(report.as_json(options, measured)))
    assert document["options"]["rounds"] == 3
    assert [r["round"] for r in document["results"]] == [1, 1, 2, 2, 3, 3]
    assert document["medians"][0]["throughput"]["median"] == 2.0


def test_one_round_reports_as_before() -> None:
    """Without --rounds the report has no round marks and no medians line."""
    measured = Measurements("t", [_result("baseline", 1, 500.0, 40.0), _result("budgetgate", 1, 1000.0, 20.0)])
    text = report.as_text(Options(requests=REQUESTS, scenarios=("hot",)), measured)
    assert "budgetgate/baseline, hot: throughput 2.00x, p99 latency 0.50x" in text
    assert "#1" not in text and "median of" not in text
    assert report.ceiling(measured) is None


def test_cpu_per_decision_is_paired_per_round_and_its_median_reported() -> None:
    """All parts (the load generator apart) per decision: budgetgate's against the baseline's of
    the same round, and each system's median over the rounds with how many were bound by waiting."""
    results = [
        _result("baseline", 1, 500.0, 40.0, service_cpu=0.10, busy=0.95),  # 1000 µs a decision
        _result("budgetgate", 1, 1000.0, 20.0, service_cpu=0.04, busy=0.95),  # 400 µs: 0.4x
        _result("budgetgate", 2, 2000.0, 10.0, service_cpu=0.03, busy=0.6),  # 300 µs
        _result("baseline", 2, 1000.0, 20.0, service_cpu=0.05, busy=0.95),  # 500 µs: 0.6x
        _result("baseline", 3, 500.0, 40.0, service_cpu=0.10, busy=0.95),
        _result("budgetgate", 3, 400.0, 80.0, service_cpu=0.05, busy=0.95),  # 500 µs: 0.5x
    ]
    measured = Measurements("t", results)

    assert [r["cpu"] for r in report.ratios(results)] == [0.4, 0.6, 0.5]
    assert report.medians(measured)[0]["cpu"] == {"median": 0.5, "low": 0.4, "high": 0.6, "rounds": 3}
    by_system = {m["system"]: m for m in report.cpu_medians(results)}
    assert by_system["budgetgate"]["all_parts_us"] == {"median": 400.0, "low": 300.0, "high": 500.0, "rounds": 3}
    assert (by_system["budgetgate"]["bound_by_waiting"], by_system["baseline"]["bound_by_waiting"]) == (1, 0)
    text = report.as_text(Options(requests=REQUESTS, scenarios=("hot",), rounds=3, ceiling=False), measured)
    assert (
        "CPU per decision, all parts, median of 3 rounds, budgetgate/hot: 400 (300-500) µs, 0.50x (0.40x-0.60x) the baseline's; "
        "machine 95% (60%-95%) busy; 1 of 3 rounds bound by waiting, not by CPU"
    ) in text


def test_the_open_loop_is_reported_per_round_and_scenario_with_the_medians_of_both_systems() -> None:
    results = [
        _result("baseline", 1, 200.0, 4.0),
        _result("budgetgate", 1, 200.0, 2.0),
        _result("budgetgate", 2, 200.0, 6.0),
        _result("baseline", 2, 200.0, 4.0),
    ]
    measured = Measurements("t", [], open_loop=results)
    options = Options(requests=REQUESTS, scenarios=("hot",), rounds=2, open_loop_rate=200.0)

    [summary] = report.open_medians(results)
    assert summary["budgetgate"]["p99_ms"] == {"median": 4.0, "low": 2.0, "high": 6.0, "rounds": 2}
    assert summary["p99_vs_baseline"] == {"median": 1.0, "low": 0.5, "high": 1.5, "rounds": 2}
    assert summary["p50_vs_baseline"]["median"] == 1.0
    document = json.loads(json.dumps(report.as_json(options, measured)))
    assert [(r["system"], r["scenario"], r["round"]) for r in document["open_loop"]] == [
        ("baseline", "hot", 1), ("budgetgate", "hot", 1), ("budgetgate", "hot", 2), ("baseline", "hot", 2)
    ]  # fmt: skip
    assert "open loop, median of 2 rounds, hot: baseline p50 1.0 (1.0-1.0) ms, p99 4.0 (4.0-4.0) ms" in report.as_text(options, measured)
