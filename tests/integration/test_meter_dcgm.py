"""`budgetgate meter dcgm` against recorded DCGM exporter pages served on loopback: the GPUs each
run holds become cumulative samples, through Kafka or HTTP, into metering-ingest's usage; an
exporter that fails (no answer, or a page that cannot say who holds its GPUs) stops only its own
node's share, neither ending its runs nor charging them for time it did not see."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from tests.support.dcgm import Exporters
from tests.support.metering import decide, usage_rows
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.principals import token_in_env  # noqa: F401 - pytest fixtures
from tests.support.servers import free_port
from tests.support.waiting import wait_for

FLYTE = "flyte/vision/exec-7f3a/n0"
TRAIN = "vision-prod/train-resnet-0"

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


async def test_over_http_a_failing_exporter_stops_only_its_own_nodes_share(exporters, metering, pg_dsn) -> None:
    await decide(pg_dsn, FLYTE)
    down = f"http://127.0.0.1:{free_port()}/metrics"
    env = {"BUDGETGATE_METERING_URL": metering.url}
    # Every exporter failing: the scrape is skipped.
    skipped = await meter("--url", down, "--interval", "0.1", "--count", "2", "--via", "http", env=env)
    assert skipped.output.count(f"scrape of {down} failed (ConnectError") == 2 and "skipping this scrape" in skipped.output
    assert await usage_rows(pg_dsn) == []
    # One of two failing: node B's runs are published at every scrape; the failure is logged at each, once.
    urls = ["--url", f"{exporters.url}/b/metrics", "--url", down]
    partial = await meter(*urls, "--labelled-only", "--interval", "0.3", "--count", "3", "--via", "http", env=env)
    assert partial.output.count(f"scrape of {down} failed (ConnectError") == 3 and partial.output.count("; 1 of 2 exporter(s) failed;") == 3
    assert "skipping this scrape" not in partial.output
    rows = await usage_rows(pg_dsn)
    assert [r["run_id"] for r in rows] == [FLYTE, FLYTE] and {r["source"] for r in rows} == {"http"}
    assert_held(rows, gpus=2, hosts=1)  # node B's share of the run: node A's was never seen


async def test_an_exporter_failing_for_a_while_neither_ends_nor_overcharges_its_runs(metering, pg_dsn, tmp_path) -> None:
    await decide(pg_dsn, FLYTE, TRAIN)
    served = Exporters(train_scrapes=10, a_empty_at=(3, 4))  # a 200 with no metrics, as an exporter restarting may give
    state = tmp_path / "meter.json"
    a, b = f"{served.url}/a/metrics", f"{served.url}/b/metrics"
    try:
        args = ["--url", a, "--url", b, "--interval", "0.3", "--count", "5", "--via", "http", "--state", str(state)]
        result = await meter(*args, env={"BUDGETGATE_METERING_URL": metering.url})
    finally:
        served.close()
    failed = f"scrape of {a} failed (the exporter page has no DCGM_FI_DEV_GPU_UTIL sample (it is empty)"
    assert result.output.count(failed) == 2 and result.output.count("; 1 of 2 exporter(s) failed;") == 2 and "skipping" not in result.output
    flyte, train = await usage_rows(pg_dsn, FLYTE), await usage_rows(pg_dsn, TRAIN)
    assert len(flyte) == len(train) == 4  # scrapes 2 to 5 (at the first, nothing was used yet)
    # While node A's page is empty, the run on both nodes goes on by node B's share...
    assert_held(flyte[:2], gpus=2, hosts=1)
    assert_held(flyte[1:3], gpus=2, hosts=1)
    # ...and the run on node A alone is still sampled (not ended), at its total so far: read as
    # "no GPU held", it would have been charged half an interval as ended.
    assert train[0]["gpu_milli_hours"] == train[1]["gpu_milli_hours"] == train[2]["gpu_milli_hours"] > 0
    # Node A answering again brings its share in: as if it had never failed.
    assert_held([flyte[0], flyte[3]], gpus=4, hosts=2)
    assert_held([train[0], train[3]], gpus=4, hosts=1)
    saved = json.loads(state.read_text())
    assert set(saved["pages"]) == {a, b} and saved["pages"][a]["at"] == saved["pages"][b]["at"] == saved["last_at"]
