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
