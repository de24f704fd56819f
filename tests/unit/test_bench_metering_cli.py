"""`budgetgate bench metering` ends with its correctness check: the report, then exit 1 when the
usage the service recorded does not add up (exit 0 when it does)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from budgetgate.benchmark import metering_runner
from budgetgate.cli.bench import bench


def _result(problems: list[str]) -> metering_runner.Result:
    return metering_runner.Result(
        tag="t", messages=11, distinct=10, runs=2, ingest_seconds=2.0, rows=10, copied=10, copy_seconds=0.5, published=10, unpublished_at_end=0,
        problems=problems,
    )  # fmt: skip


@pytest.mark.parametrize(("problems", "exit_code"), [([], 0), (["run r: cumulative Counters(gpu=1, node=0), expected Counters(gpu=2, node=0)"], 1)])
def test_the_run_exits_by_its_check(monkeypatch: pytest.MonkeyPatch, problems: list[str], exit_code: int) -> None:
    async def measured(_options: metering_runner.Options, *, echo: object) -> list[metering_runner.Result]:
        return [_result(problems)]

    monkeypatch.setattr(metering_runner, "run", measured)
    outcome = CliRunner().invoke(bench, ["metering", "--samples", "10"])
    assert outcome.exit_code == exit_code
    assert "ratio (metering-ingest / COPY, rows/s): 0.25x (COPY: the best of 3)" in outcome.output
    if problems:
        assert f"correctness: FAILED - {problems[0]}" in outcome.output and "correctness check failed" in outcome.output
    else:
        assert "correctness: OK" in outcome.output


def test_the_cpu_bound_is_given_in_rows_and_held_against_copy() -> None:
    # 1100 samples (1000 rows: a tenth are resends) cost 0.05 + 0.03 + 0.0025 = 0.0825 CPU
    # seconds, 75 µs a sample: 2 CPUs hold 26,667 samples/s, 24,242 rows/s; COPY wrote 100,000.
    from budgetgate.benchmark import metering_report
    from budgetgate.benchmark.cpu import CpuUse

    result = metering_runner.Result(
        tag="t", messages=1100, distinct=1000, runs=10, ingest_seconds=0.1, rows=1000, copied=1000, copy_seconds=0.01, published=1000, unpublished_at_end=0,
        cpu=CpuUse(seconds=0.06, parts={"service": 0.05, "postgres": 0.03, "broker": 0.0025}, machine_busy=0.7, cpus=2), cpu_samples=1100,
    )  # fmt: skip

    report = metering_report.as_json(metering_runner.Options(), [result])
    assert report["cpu"]["bound_per_second"] == pytest.approx(26666.7)
    assert report["cpu"]["bound"] == {"rows_per_second": pytest.approx(24242.4), "ratio_rows_per_second": pytest.approx(0.24242)}
    text = metering_report.as_text(metering_runner.Options(), [result])
    assert (
        "  all 2 CPUs, busy with this alone, would hold at most 26667 samples/s at these costs: 2.42x metering-ingest's measured 11000/s; "
        "in rows 24242/s: 0.24242x COPY"
    ) in text


def test_the_cpu_per_sample_is_held_against_copys_cpu_per_row() -> None:
    # The service's 1100 samples cost 0.0825 CPU seconds in all (75 µs a sample); COPY's 1000
    # rows cost its client 0.006 and its server 0.009 (15 µs a row): 5x.
    from budgetgate.benchmark import metering_report
    from budgetgate.benchmark.cpu import CpuUse

    result = metering_runner.Result(
        tag="t", messages=1100, distinct=1000, runs=10, ingest_seconds=0.1, rows=1000, copied=1000, copy_seconds=0.01, published=1000, unpublished_at_end=0,
        cpu=CpuUse(seconds=0.06, parts={"service": 0.05, "postgres": 0.03, "broker": 0.0025}, machine_busy=0.7, cpus=2), cpu_samples=1100,
        copy_cpu=CpuUse(seconds=0.01, parts={"client": 0.006, "postgres": 0.009}, machine_busy=0.6, cpus=2),
    )  # fmt: skip

    report = metering_report.as_json(metering_runner.Options(), [result])
    assert report["copy"]["cpu"]["us_per_unit"] == {"client": pytest.approx(6.0), "postgres": pytest.approx(9.0)}
    assert report["copy"]["cpu"]["all_parts_us_per_unit"] == pytest.approx(15.0)
    assert report["cpu_ratio_to_copy"] == 5.0
    text = metering_report.as_text(metering_runner.Options(), [result])
    assert "COPY (the fastest of 3), CPU µs per row: all parts 15 (client 6, postgres 9)" in text
    assert "metering-ingest's CPU per sample, all parts, is 5.0x COPY's per row" in text

    # Unknown on either side (a broker on another host), no ratio rather than a false one.
    unknown = metering_runner.Result(**{**result.__dict__, "cpu": CpuUse(seconds=0.06, parts={"service": 0.05, "broker": None}, machine_busy=0.7, cpus=2)})
    assert metering_report.as_json(metering_runner.Options(), [unknown])["cpu_ratio_to_copy"] is None


def _round(*, ingest_seconds: float, copy_seconds: float, service: float, problems: list[str] | None = None) -> metering_runner.Result:
    from budgetgate.benchmark.cpu import CpuUse
    from budgetgate.benchmark.pauses import Collections

    return metering_runner.Result(
        tag="t", messages=1100, distinct=1000, runs=10, ingest_seconds=ingest_seconds, rows=1000, copied=1000, copy_seconds=copy_seconds, published=1000,
        unpublished_at_end=0, problems=problems or [],
        cpu=CpuUse(seconds=0.06, parts={"service": service, "postgres": 0.03, "broker": 0.0025}, machine_busy=0.7, cpus=2), cpu_samples=1100,
        collections=Collections(passes=(2, 1, 0), seconds=(0.01, 0.01, 0.0), cpu_seconds=1.0),
    )  # fmt: skip


def test_rounds_report_the_median_round_and_the_spread_of_each_figure() -> None:
    from budgetgate.benchmark import metering_report

    # Ratios 0.1 (round 1), 0.3 (round 2, its COPY slow), 0.2 (round 3): round 3 is the median.
    results = [
        _round(ingest_seconds=0.1, copy_seconds=0.01, service=0.11),
        _round(ingest_seconds=0.1, copy_seconds=0.03, service=0.055),
        _round(ingest_seconds=0.05, copy_seconds=0.01, service=0.066),
    ]
    report = metering_report.as_json(metering_runner.Options(rounds=3), results)

    assert [r["ratio_rows_per_second"] for r in report["rounds"]] == [0.1, 0.3, 0.2]
    assert report["median_round"] == 3 and report["ratio_rows_per_second"] == 0.2 and report["ingest"]["rows_per_second"] == 20000.0
    assert report["medians"]["ratio_rows_per_second"] == {"median": 0.2, "low": 0.1, "high": 0.3, "rounds": 3}
    assert report["medians"]["rows_per_second"] == {"median": 10000.0, "low": 10000.0, "high": 20000.0, "rounds": 3}
    assert report["medians"]["copy_rows_per_second"]["median"] == 100000.0
    assert report["medians"]["service_us_per_sample"] == {"median": 60.0, "low": 50.0, "high": 100.0, "rounds": 3}
    assert report["correct"] is True and report["problems"] == []

    text = metering_report.as_text(metering_runner.Options(rounds=3), results)
    assert "round 2: metering-ingest 10000 rows/s, COPY 33333 rows/s: 0.3x; CPU µs per sample: service 50, postgres 27, broker 2" in text
    assert "garbage collection 2.0% of the service's CPU" in text
    assert "the median round (3):" in text and "ratio (metering-ingest / COPY, rows/s): 0.2x (COPY: the best of 3)" in text
    assert "median of 3 rounds: ratio (metering-ingest / COPY, rows/s) 0.2x (0.1x-0.3x); metering-ingest rows/s 10000 (10000-20000)" in text


def test_a_round_that_fails_its_check_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = _round(ingest_seconds=0.1, copy_seconds=0.01, service=0.1, problems=["1 usage row too many"])
    results = [_round(ingest_seconds=0.1, copy_seconds=0.01, service=0.1), failing]  # equal ratios: round 1 is the median round

    async def measured(_options: metering_runner.Options, *, echo: object) -> list[metering_runner.Result]:
        return results

    monkeypatch.setattr(metering_runner, "run", measured)
    outcome = CliRunner().invoke(bench, ["metering", "--rounds", "2"])
    assert outcome.exit_code == 1
    assert "round 2: metering-ingest 10000 rows/s, COPY 100000 rows/s: 0.1x" in outcome.output and "FAILED its check" in outcome.output
    assert "the median round (1):" in outcome.output and "correctness: OK" in outcome.output
    assert "correctness: FAILED - round 2: 1 usage row too many" in outcome.output and "correctness check failed" in outcome.output


def test_replicas_are_named_with_the_samples_each_took_and_their_cpu_beside_the_sum() -> None:
    from budgetgate.benchmark import metering_report
    from budgetgate.benchmark.cpu import CpuUse

    cpu = CpuUse(
        seconds=0.5, parts={"service 1": 0.02, "service 2": 0.04, "postgres": 0.03, "broker": 0.0025}, machine_busy=0.7, cpus=2,
        groups={"service": ("service 1", "service 2")},
    )  # fmt: skip
    result = metering_runner.Result(
        tag="t", messages=1100, distinct=1000, runs=10, ingest_seconds=0.6, rows=1000, copied=1000, copy_seconds=0.01, published=1000, unpublished_at_end=0,
        cpu=cpu, cpu_samples=1000, replicas=2, consumed_by_replica=[400, 700],
    )  # fmt: skip
    options = metering_runner.Options(replicas=2)

    report = metering_report.as_json(options, [result])
    assert report["consumed_by_replica"] == {"service 1": 400, "service 2": 700}
    assert report["window"] == {"samples": 1000, "seconds": 0.5, "samples_per_second": 2000.0}
    assert report["cpu"]["group_us_per_unit"] == {"service": pytest.approx(60.0)} and report["cpu"]["all_parts_us_per_unit"] == pytest.approx(92.5)
    text = metering_report.as_text(options, [result])
    assert "2 metering-ingest processes in one consumer group: service 1 took 400 samples, service 2 took 700 samples" in text
    assert (
        "from the first commit with every replica in the group (1000 samples in 0.50 s = 2000/s), CPU µs per sample consumed: "
        "all parts 92 (service 60 = service 1 20 + service 2 40, postgres 30, broker 2)"
    ) in text
    rounds = metering_report.as_json(metering_runner.Options(replicas=2, rounds=2), [result, result])
    assert rounds["medians"]["service_us_per_sample"]["median"] == pytest.approx(60.0)
    assert list(rounds["medians"]["us_per_sample"]) == ["service 1", "service 2", "postgres", "broker"]
    text = metering_report.as_text(metering_runner.Options(replicas=2, rounds=2), [result, result])
    assert "round 1: metering-ingest 1667 rows/s, COPY 100000 rows/s: 0.01667x; CPU µs per sample: service 60 = service 1 20 + service 2 40" in text
    assert "samples/s with every replica in the group 2000 (2000-2000)" in text


def test_more_replicas_than_partitions_is_refused() -> None:
    outcome = CliRunner().invoke(bench, ["metering", "--partitions", "2", "--replicas", "3"])
    assert outcome.exit_code == 2 and "replicas (3) must be at most partitions (2)" in outcome.output


def test_the_ratio_is_held_in_distinct_samples_when_the_service_folds_them_into_fewer_rows() -> None:
    # 1000 distinct samples in 2 s, written as 250 usage rows (a run's quarter hour in one poll is
    # one point); COPY loads a row per distinct sample, 1000 in 0.5 s: 500/s against 2000/s.
    from budgetgate.benchmark import metering_report

    result = metering_runner.Result(
        tag="t", messages=1100, distinct=1000, runs=10, ingest_seconds=2.0, rows=250, copied=1000, copy_seconds=0.5, published=250, unpublished_at_end=0,
    )  # fmt: skip
    report = metering_report.as_json(metering_runner.Options(), [result])
    assert report["ingest"]["rows_per_second"] == 500.0 and report["copy"]["rows_per_second"] == 2000.0 and report["ratio_rows_per_second"] == 0.25
    assert report["ingest"]["usage_rows"] == 250 and report["copy"]["rows"] == 1000
    assert "metering-ingest wrote 250 usage rows" in metering_report.as_text(metering_runner.Options(), [result])
