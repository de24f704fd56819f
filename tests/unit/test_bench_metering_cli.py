"""`budgetgate bench metering` ends with its correctness check: the report, then exit 1 when the
usage the service recorded does not add up (exit 0 when it does)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from budgetgate.benchmark import metering_runner
from budgetgate.cli.bench import bench


def _result(problems: list[str]) -> metering_runner.Result:
    return metering_runner.Result(
        tag="t", messages=11, distinct=10, runs=2, ingest_seconds=2.0, rows=10, copy_seconds=0.5, published=10, unpublished_at_end=0, problems=problems
    )


@pytest.mark.parametrize(("problems", "exit_code"), [([], 0), (["run r: cumulative Counters(gpu=1, node=0), expected Counters(gpu=2, node=0)"], 1)])
def test_the_run_exits_by_its_check(monkeypatch: pytest.MonkeyPatch, problems: list[str], exit_code: int) -> None:
    async def measured(_options: metering_runner.Options, *, echo: object) -> metering_runner.Result:
        return _result(problems)

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
        tag="t", messages=1100, distinct=1000, runs=10, ingest_seconds=0.1, rows=1000, copy_seconds=0.01, published=1000, unpublished_at_end=0,
        cpu=CpuUse(seconds=0.06, parts={"service": 0.05, "postgres": 0.03, "broker": 0.0025}, machine_busy=0.7, cpus=2), cpu_samples=1100,
    )  # fmt: skip

    report = metering_report.as_json(metering_runner.Options(), result)
    assert report["cpu"]["bound_per_second"] == pytest.approx(26666.7)
    assert report["cpu"]["bound"] == {"rows_per_second": pytest.approx(24242.4), "ratio_rows_per_second": pytest.approx(0.24242)}
    text = metering_report.as_text(metering_runner.Options(), result)
    assert (
        "  all 2 CPUs, busy with this alone, would hold at most 26667 samples/s at these costs: 2.42x metering-ingest's measured 11000/s; "
        "in rows 24242/s: 0.24242x COPY"
    ) in text
