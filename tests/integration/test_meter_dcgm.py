"""`budgetgate meter dcgm` against recorded DCGM exporter pages served on loopback: the GPUs each
run holds become cumulative samples, through Kafka or HTTP, into metering-ingest's usage; an
exporter that fails (no answer, or a page that cannot say who holds its GPUs) stops only its own
node's share, neither ending its runs nor charging them for time it did not see. Exporters found
through a stand-in Kubernetes API server, and the pods holding GPUs looked up there: MIG slices,
time-sliced GPUs, a hashed run label resolved, a restart going on from the kept state, and a pod
that ended charged up to its end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from budgetgate.cli.main import cli
from budgetgate.core.principals import Role
from budgetgate.runtime.settings import DEV_STATE_FILE
from budgetgate.platforms.run_labels import RUN_ANNOTATION, RUN_LABEL, run_label_value
from tests.support.dcgm import Exporters, NodeExporter, container_status, exporter_pod, gpu_pod, kubeconfig_file
from tests.support.kube_api import KubeApi, kube  # noqa: F401 - pytest fixture
from tests.support.metering import decide, fetchval, usage_rows
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.principals import issue, token_in_env  # noqa: F401 - pytest fixtures
from tests.support.servers import free_port
from tests.support.waiting import wait_for

FLYTE = "flyte/vision/exec-7f3a/n0"
TRAIN = "vision-prod/train-resnet-0"

pytestmark = pytest.mark.usefixtures("token_in_env")


@pytest.fixture(autouse=True)
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a meter not given --state keeps it (its default, under XDG_STATE_HOME): this test's own."""
    home = tmp_path / "state-home"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home


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


SWEEP = "flyte/nlp/sweep-7/n0"  # annotated on its Job; no label value, so the pods carry its hash
SWEEP_JOB_UID = "6b7c8d9e-0f1a-4b2c-9d3e-4f5a6b7c8d02"


def cluster(api: KubeApi) -> None:
    """The pods holding GPUs on node E (MIG) and node D (time-sliced), as the API has them."""
    job = {"batch.kubernetes.io/controller-uid": SWEEP_JOB_UID, "batch.kubernetes.io/job-name": "sweep-7"}
    for name, run in (("finetune-0-7xk2p", "exp-42"), ("finetune-1-r8d3w", "exp-42"), ("eval-0-m2n7c", "exp-43")):
        api.put("pods", gpu_pod("nlp-prod", name, labels={RUN_LABEL: run}, node="gpu-node-e"))
    labels = {RUN_LABEL: run_label_value(SWEEP), **job}
    api.put("pods", gpu_pod("nlp-prod", "sweep-7-0-q4m9z", labels=labels, annotations={RUN_ANNOTATION: SWEEP}, node="gpu-node-e"))
    for name, run in (("chat-a-0", "chat-a"), ("chat-a-1", "chat-a"), ("chat-b-0", "chat-b"), ("chat-b-1", "chat-b")):
        api.put("pods", gpu_pod("serving", name, labels={RUN_LABEL: run}, node="gpu-node-d"))


async def test_exporters_and_pods_found_through_the_kubernetes_api(metering, pg_dsn, kube, tmp_path, state_home) -> None:
    api, url = kube
    runs = ("exp-42", "exp-43", SWEEP, "chat-a", "chat-b")
    await decide(pg_dsn, *runs)
    cluster(api)
    e, d = NodeExporter("node-e-mig.prom"), NodeExporter("node-d-time-sliced.prom")
    api.put("pods", exporter_pod("gpu-node-e", e.port))
    api.put("pods", exporter_pod("gpu-node-d", d.port, running=False))  # scheduled, not started yet
    config = kubeconfig_file(tmp_path / "kubeconfig.json", url)
    args = ["--discover", "gpu-operator", "--kubeconfig", str(config), "--discover-every", "0.2", "--interval", "0.3", "--via", "http"]
    env = {"BUDGETGATE_METERING_URL": metering.url}

    async def node_d_starts() -> None:
        await wait_for(lambda: e.scrapes >= 2, what="node E's exporter scraped twice")
        api.put("pods", exporter_pod("gpu-node-d", d.port))

    try:
        starting = asyncio.create_task(node_d_starts())
        first = await meter(*args, "--count", "7", env=env)
        await starting
        # Node D's exporter is found once it runs (the pods are listed again every 0.2 s).
        assert e.scrapes == 7 and 2 <= d.scrapes < 7, (e.scrapes, d.scrapes)
        assert "1 exporter(s) found in gpu-operator" in first.output and "2 exporter(s) found in gpu-operator" in first.output

        rows = {run: await usage_rows(pg_dsn, run) for run in runs}
        # MIG: exp-42 holds a 3g.40gb and a 1g.10gb instance of an A100 (4/7 of a GPU), the
        # sweep a 2g.20gb one (2/7); exp-43 the node's whole GPU.
        assert_held(rows["exp-42"], gpus=4 / 7, hosts=1)
        assert_held(rows[SWEEP], gpus=2 / 7, hosts=1)
        assert_held(rows["exp-43"], gpus=1, hosts=1)
        # Time-slicing: GPU 0 of node D shared by chat-a-0, chat-b-0 and chat-b-1, GPU 1 by chat-a-1.
        assert_held(rows["chat-a"], gpus=1 / 3 + 1, hosts=1)
        assert_held(rows["chat-b"], gpus=2 / 3, hosts=1)
        # The sweep's hash and its Job's UID were never published as a run id.
        for table in ("usage_records", "metering_pending"):
            assert await fetchval(pg_dsn, f"SELECT count(*) FROM {table} WHERE NOT run_id = ANY($1::text[])", list(runs)) == 0
        assert (state_home / "budgetgate" / "meter-dcgm-dcgm.json").exists()  # the default state

        # The sweep's pod finishes; the kubelet (node E's page) still reports its MIG instance.
        before = {run: len(found) for run, found in rows.items()}
        await asyncio.sleep(1.1)
        finished = datetime.now(UTC).replace(microsecond=0)
        ended = api.get("pods", "sweep-7-0-q4m9z", "nlp-prod")
        ended["status"] = {
            "phase": "Succeeded",
            "containerStatuses": [
                container_status({"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": finished.isoformat().replace("+00:00", "Z")}}, ready=False)
            ],
        }
        api.put("pods", ended)
        # A restarted meter, without --state: it goes on from the state kept by default, so none
        # of its samples is rejected as a counter regression.
        second = await meter(*args, "--count", "3", env=env)
    finally:
        e.close()
        d.close()
    assert "1 pod(s) ended or deleted, no longer charged: nlp-prod/sweep-7-0-q4m9z" in second.output
    exp42 = await usage_rows(pg_dsn, "exp-42")
    assert len(exp42) == before["exp-42"] + 3
    assert_held(exp42[before["exp-42"] - 1 : before["exp-42"] + 1], gpus=4 / 7, hosts=1)  # the interval across the restart, counted
    sweep = await usage_rows(pg_dsn, SWEEP)
    last_running, after = sweep[before[SWEEP] - 1], sweep[before[SWEEP] :]
    assert len(after) == 3  # reported while the kubelet still shows it
    up_to_end = (finished - last_running["observed_at"]).total_seconds() * 1000
    assert abs(after[0]["gpu_milli_hours"] - last_running["gpu_milli_hours"] - 2 / 7 * up_to_end) <= 1
    assert abs(after[0]["node_milli_hours"] - last_running["node_milli_hours"] - up_to_end) <= 1
    assert {r["gpu_milli_hours"] for r in after} == {after[0]["gpu_milli_hours"]}  # nothing past its end


async def test_the_newest_exporter_pod_of_a_node_is_scraped(kube, tmp_path) -> None:
    from lightkube import AsyncClient as KubeClient
    from lightkube import KubeConfig

    from budgetgate.adapters.dcgm_discovery import discover_exporters

    api, url = kube
    old, new = exporter_pod("gpu-node-a", 9401), exporter_pod("gpu-node-a", 9402)
    new["metadata"]["name"], new["metadata"]["creationTimestamp"] = "dcgm-exporter-gpu-node-a-2", "2026-07-14T09:00:00Z"
    other = exporter_pod("gpu-node-b", 9403)
    other["metadata"]["labels"] = {"app.kubernetes.io/name": "something-else"}
    for pod in (new, old, other, exporter_pod("gpu-node-c", 9404, namespace="elsewhere")):
        api.put("pods", pod)
    config = KubeConfig.from_file(kubeconfig_file(tmp_path / "kubeconfig.json", url))
    client = KubeClient(config)
    try:
        found = await discover_exporters(client, namespace="gpu-operator", selector="app.kubernetes.io/name=dcgm-exporter", port=9400)
    finally:
        await client.close()
    assert found == {"node/gpu-node-a": "http://127.0.0.1:9402/metrics"}  # a rollout's newer pod; other labels and namespaces left out


async def test_a_kubernetes_api_that_fails_skips_the_scrape(exporters, metering, pg_dsn, tmp_path) -> None:
    await decide(pg_dsn, FLYTE)
    config = kubeconfig_file(tmp_path / "kubeconfig.json", f"http://127.0.0.1:{free_port()}")
    args = ["--url", f"{exporters.url}/b/metrics", "--kubernetes", "--kubeconfig", str(config), "--interval", "0.1", "--count", "2", "--via", "http"]
    result = await meter(*args, env={"BUDGETGATE_METERING_URL": metering.url})
    # Without the pods, which of them ended is not known: nothing is charged (the interval is
    # counted when the API answers again within --max-gap).
    assert result.output.count("looking up 1 pod(s) through the Kubernetes API failed") == 2 and "skipping this scrape" in result.output
    assert await usage_rows(pg_dsn) == []


async def test_over_http_the_meter_sends_its_token_or_the_local_stacks_exporter_token(exporters, metering, pg_dsn, tmp_path, monkeypatch) -> None:
    """No BUDGETGATE_TOKEN: `--token`, else the exporter token of the stack `dev up` started."""
    await decide(pg_dsn, FLYTE)
    monkeypatch.delenv("BUDGETGATE_TOKEN")
    state = str(tmp_path / "meter.json")
    args = ["--url", f"{exporters.url}/b/metrics", "--labelled-only", "--interval", "0.1", "--count", "2", "--via", "http", "--state", state]
    env = {"BUDGETGATE_METERING_URL": metering.url}
    refused = await asyncio.to_thread(CliRunner().invoke, cli, ["meter", "dcgm", *args], env={"BUDGETGATE_HOME": "", **env})
    assert "401 Unauthorized: no credentials" in refused.output, refused.output  # said at each scrape; the meter goes on
    assert await usage_rows(pg_dsn) == []

    own = await issue(pg_dsn, Role.EXPORTER)
    await meter(*args, "--token", own, env=env)
    sent = await wait_for(lambda: _rows(pg_dsn, 0), what="the samples sent with --token")

    stack = tmp_path / "stack"
    (stack / DEV_STATE_FILE).parent.mkdir(parents=True)
    (stack / DEV_STATE_FILE).write_text(json.dumps({"tokens": {"exporter": await issue(pg_dsn, Role.EXPORTER), "operator": "not-this-one"}}))
    await meter(*args, env={**env, "BUDGETGATE_HOME": str(stack)})
    await wait_for(lambda: _rows(pg_dsn, sent), what="the samples sent with the stack's exporter token")


async def _rows(dsn: str, more_than: int) -> int:
    """How many samples of FLYTE were recorded, once more than `more_than` were (else 0)."""
    found = len(await usage_rows(dsn, FLYTE))
    return found if found > more_than else 0
