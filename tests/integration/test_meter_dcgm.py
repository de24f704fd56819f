"""`budgetgate meter dcgm` against recorded DCGM exporter pages served on loopback: the GPUs each
run holds become cumulative samples, through Kafka or HTTP, into metering-ingest's usage; a page
that cannot say who holds its GPUs publishes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from tests.support.dcgm import Exporters
from tests.support.metering import decide, metering, metering_factory, usage_rows, wait_for  # noqa: F401 - pytest fixtures
from tests.support.servers import PageServer, free_port

FLYTE = "flyte/vision/exec-7f3a/n0"
TRAIN = "vision-prod/train-resnet-0"
from tests.support.principals import token_in_env  # noqa: F401 - a fixture, used by name

pytestmark = pytest.mark.usefixtures("token_in_env")


@pytest.fixture
def exporters() -> Iterator[Exporters]:
    served = Exporters(train_scrapes=2)
    yield served
    served.close()


async def meter(*args: str, env: dict[str, str]) -> Result:
    # The command runs its own event loop; the services run on this test's, so it gets a thread.
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["meter", "dcgm", *args], env={"BUDGETGATE_HOME": "", **env})
    assert result.exit_code == 0, result.output
    return result


def assert_held(rows, gpus: float, hosts: float) -> None:  # type: ignore[no-untyped-def]
    """Between two consecutive samples the run was charged `gpus` GPUs and `hosts` nodes for the
    time between their observations (to the millisecond of rounding)."""
    before, after = rows[-2], rows[-1]
    ms = (after["observed_at"] - before["observed_at"]).total_seconds() * 1000
    assert abs(after["gpu_milli_hours"] - before["gpu_milli_hours"] - gpus * ms) <= 1
    assert abs(after["node_milli_hours"] - before["node_milli_hours"] - hosts * ms) <= 1


async def test_scrapes_become_cumulative_samples_on_kafka(exporters, metering, settings, pg_dsn, tmp_path) -> None:
    await decide(pg_dsn, FLYTE, TRAIN)
    state = tmp_path / "meter.json"
    env = {"BUDGETGATE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "BUDGETGATE_TOPIC_PREFIX": settings.topic_prefix}
    await meter(
        "--url", f"{exporters.url}/a/metrics", "--url", f"{exporters.url}/b/metrics", "--interval", "0.3", "--count", "3", "--state", str(state), env=env
    )
    assert exporters.scrapes == {"a": 3, "b": 3}

    async def both_sampled() -> bool:
        return len(await usage_rows(pg_dsn, FLYTE)) == 2 and len(await usage_rows(pg_dsn, TRAIN)) == 2

    await wait_for(both_sampled, what="two samples of each run consumed from Kafka")
    flyte, train = await usage_rows(pg_dsn, FLYTE), await usage_rows(pg_dsn, TRAIN)
    assert {r["source"] for r in flyte + train} == {"kafka"} and {r["exporter"] for r in flyte} == {"dcgm"}
    assert_held(flyte, gpus=4, hosts=2)  # 2 GPUs on each of two nodes, one run by its run-id label
    assert_held(train, gpus=2, hosts=0.5)  # 4 GPUs on one node held at one end of the interval, none at the other: half
    assert flyte[0]["gpu_milli_hours"] > 0 and flyte[1]["gpu_milli_hours_cumulative"] == flyte[1]["gpu_milli_hours"]
    # The totals are kept for a restarted meter.
    saved = json.loads(state.read_text())
    assert saved["totals"][FLYTE][0] * 1000 == pytest.approx(flyte[1]["gpu_milli_hours"], abs=1)


async def test_over_http_and_a_failed_scrape_publishes_nothing(exporters, metering, pg_dsn) -> None:
    await decide(pg_dsn, FLYTE)
    down = f"http://127.0.0.1:{free_port()}/metrics"
    env = {"BUDGETGATE_METERING_URL": metering.url}
    failed = await meter("--url", f"{exporters.url}/b/metrics", "--url", down, "--interval", "0.1", "--count", "2", "--via", "http", env=env)
    assert "skipping this scrape" in failed.output and await usage_rows(pg_dsn) == []
    await meter("--url", f"{exporters.url}/b/metrics", "--labelled-only", "--interval", "0.3", "--count", "3", "--via", "http", env=env)
    rows = await usage_rows(pg_dsn)
    assert [r["run_id"] for r in rows] == [FLYTE, FLYTE] and {r["source"] for r in rows} == {"http"}
    assert_held(rows, gpus=2, hosts=1)  # node B alone: 2 GPUs of the run


async def test_an_exporter_answering_an_empty_page_charges_nothing_rather_than_ending_runs(exporters, metering, pg_dsn) -> None:
    await decide(pg_dsn, FLYTE)
    empty = PageServer(lambda path: (b"", "text/plain; version=0.0.4; charset=utf-8"))  # a 200 with no metrics, as an exporter restarting may give
    try:
        urls = ["--url", f"{exporters.url}/b/metrics", "--url", f"{empty.url}/metrics"]
        args = ["meter", "dcgm", *urls, "--interval", "0.2", "--count", "3", "--via", "http"]
        result = await asyncio.to_thread(CliRunner().invoke, cli, args, env={"BUDGETGATE_HOME": "", "BUDGETGATE_METERING_URL": metering.url})
    finally:
        empty.close()
    # Each scrape is skipped, as one an exporter did not answer, and the meter goes on.
    assert result.exit_code == 0, result.output
    assert result.output.count("exporter page 2 of 2 has no DCGM_FI_DEV_GPU_UTIL sample") == 3 and "skipping this scrape" in result.output
    # Read as "no GPU held" on that node, node B's share of the run would have been published as all of it.
    assert await usage_rows(pg_dsn) == []
