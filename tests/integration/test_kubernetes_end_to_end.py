"""One GPU Job walked end to end on the stand-in API server, every part budgetgate ships running for
real (admission with both webhooks, metering-ingest, the reconciler, Kafka, the lifecycle
controller electing itself on a Lease, `budgetgate meter dcgm` scraping an exporter page):

created → the mutating webhook names its run and labels its pod template → the API server stores
it with a UID → the validating webhook decides it under that run, holding provisionally → the
controller sees it stored (STORED: the hold is confirmed) → the Job controller makes its pod from
the template, so the pod carries the run's label → the pod runs (STARTED) → the meter charges the
GPUs the exporter shows under that label to the run → the Job completes (COMPLETED) → the
reconciler replaces the reservation with the metered actuals, and nothing is held after."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from click.testing import CliRunner
from lightkube import AsyncClient as KubeClient

from budgetgate.adapters.leases import LeaderElection
from budgetgate.adapters.lifecycle_controller import LifecycleController
from budgetgate.cli.main import cli
from budgetgate.client import AsyncClient
from budgetgate.core.principals import Role
from budgetgate.platforms.run_labels import RUN_LABEL, pod_run_id
from tests.support.dcgm import container_status, kubeconfig_file
from tests.support.kube_api import KubeApi, kube, kubeconfig  # noqa: F401 - pytest fixture
from tests.support.kubernetes import JOB_CONTROLLER, job, mutated, pod_of, stored, unstored, validated
from tests.support.metering import metering, metering_factory, usage_rows  # noqa: F401 - pytest fixtures
from tests.support.principals import issue, token_in_env  # noqa: F401 - pytest fixtures
from tests.support.reconciler import ledger_in_postgres, ledger_in_redis, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.servers import PageServer
from tests.support.waiting import wait_for

H100 = {"budgetgate.io/flavor": "h100"}
GPUS = ("GPU-1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a51", "GPU-6f5e4d3c-2b1a-4098-8f7e-6d5c4b3a2f62")


def stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exporter_page(pod: dict[str, Any]) -> bytes:
    """dcgm-exporter's page for one node whose two GPUs `pod` holds, its pod labels exported
    (`--kubernetes-enable-pod-labels`: budgetgate.io/run-id becomes budgetgate_io_run_id)."""
    meta = pod["metadata"]
    lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
    for gpu, uuid in enumerate(GPUS):
        labels = (
            f'gpu="{gpu}",UUID="{uuid}",pci_bus_id="00000000:1{gpu}:00.0",device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",'
            f'Hostname="gpu-node-e2e",container="trainer",namespace="{meta["namespace"]}",pod="{meta["name"]}",'
            f'budgetgate_io_run_id="{meta["labels"][RUN_LABEL]}"'
        )
        lines.append(f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 93")
    return ("\n".join(lines) + "\n").encode()


async def figures(dsn: str, run_id: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        return {
            "reservations": {r["state"] for r in await conn.fetch("SELECT state FROM reservations WHERE run_id = $1", run_id)},
            "holds": await conn.fetchval("SELECT count(*) FROM run_holds WHERE run_id = $1 AND state = 'held'", run_id),
            "provisional": await conn.fetchval("SELECT count(*) FROM provisional_holds WHERE run_id = $1", run_id),
            "events": [r["kind"] for r in await conn.fetch("SELECT kind FROM lifecycle_events WHERE run_id = $1 ORDER BY event_time, kind", run_id)],
            "keys": [r["ledger_key"] for r in await conn.fetch("SELECT ledger_key FROM reservations WHERE run_id = $1", run_id)],
        }
    finally:
        await conn.close()


async def test_one_gpu_job_from_creation_to_actuals_on_the_stand_in(  # type: ignore[no-untyped-def]
    kube, admission, metering, reconciler_factory, pg_dsn, tmp_path: Path, token_in_env
) -> None:
    api, url = kube
    reconciler = await reconciler_factory(provisional_hold_seconds=20)
    await wait_for(lambda: reconciler.consuming, what="the reconciler consuming")

    # The user creates a Job; the API server calls the mutating webhook (no UID yet), stores the
    # patched object with a UID, and calls the validating webhook.
    created = unstored(job("train-e2e", gpus=2, parallelism=1, deadline=2 * 3600, annotations=H100))
    _, named = await mutated(admission, created)
    run_id = named["metadata"]["annotations"]["budgetgate.io/run-id"]
    template = named["spec"]["template"]
    assert pod_run_id(template) == run_id  # the pods it makes will carry the run
    job_obj = stored(named)
    assert (await validated(admission, job_obj))["allowed"] is True
    decided = (await admission.client.get(f"/v1/admissions/{run_id}")).json()
    assert decided["decision"] == "ALLOW" and decided["projected_gpu_hours"] == 4.0
    held = await figures(pg_dsn, run_id)
    assert held["reservations"] == {"held"} and held["provisional"] == 1  # a webhook hold is provisional until the object is seen stored
    job_obj["metadata"]["creationTimestamp"] = stamp(datetime.now(UTC))
    api.put("jobs", job_obj)

    # The lifecycle controller, leader on its Lease, reports what the cluster does.
    exporter_token = await issue(pg_dsn, Role.EXPORTER)
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    feed = AsyncClient(metering_url=metering.url, token=exporter_token)
    election = LeaderElection(
        kube_client, name="budgetgate-lifecycle", namespace="budgetgate", identity="e2e", lease_seconds=3, renew_deadline_seconds=2, retry_seconds=0.2
    )
    controller = LifecycleController(kube=kube_client, publish=lambda events: feed.publish_lifecycle(*events), election=election, backoff_seconds=0.2)
    running = asyncio.create_task(controller.run())
    page = PageServer(lambda _path: (exporter_page(pod), "text/plain; version=0.0.4; charset=utf-8"))
    try:

        async def seen(kind: str) -> bool:
            return kind in (await figures(pg_dsn, run_id))["events"]

        await wait_for(lambda: seen("STORED"), timeout=60, what="STORED of the stored Job")

        async def confirmed() -> bool:  # the reconciler settles the fact: the hold follows the start deadline now
            return (await figures(pg_dsn, run_id))["provisional"] == 0

        await wait_for(confirmed, timeout=30, what="the provisional hold confirmed")

        # The Job controller makes the pod from the template; the kubelet runs it.
        pod = pod_of(job_obj, "train-e2e-0", template)
        meta = pod["metadata"]
        meta.update(uid="7a1c2d3e-4f50-4617-8829-3a4b5c6d7e80", creationTimestamp=stamp(datetime.now(UTC)))
        pod["spec"]["nodeName"] = "gpu-node-e2e"
        pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
        assert (await validated(admission, pod, user=JOB_CONTROLLER))["allowed"] is True  # passes on its Job: no second decision
        pod["status"] = {"phase": "Running", "containerStatuses": [container_status({"running": {"startedAt": stamp(datetime.now(UTC))}})]}
        api.put("pods", pod)
        await wait_for(lambda: seen("STARTED"), timeout=60, what="STARTED of the running pod")

        # The meter scrapes the node's exporter, asking the API about the pods it names.
        config = kubeconfig_file(tmp_path / "kubeconfig", url)
        args = ["meter", "dcgm", "--url", f"{page.url}/metrics", "--kubernetes", "--kubeconfig", str(config), "--labelled-only"]
        args += ["--interval", "1", "--count", "4", "--via", "http", "--state", str(tmp_path / "meter.json")]
        env = {"BUDGETGATE_METERING_URL": metering.url, "BUDGETGATE_HOME": ""}
        metered = await asyncio.to_thread(CliRunner().invoke, cli, args, env=env)
        assert metered.exit_code == 0, metered.output
        rows = await wait_for(lambda: usage_rows(pg_dsn, run_id), timeout=30, what="the run's GPU samples recorded")
        assert all(r["exporter"] == "dcgm" for r in rows)

        # The pod ends, the Job completes.
        finished = stamp(datetime.now(UTC))
        pod["status"] = {
            "phase": "Succeeded",
            "containerStatuses": [container_status({"terminated": {"startedAt": finished, "finishedAt": finished, "exitCode": 0}}, ready=False)],
        }
        api.put("pods", pod)
        done = api.get("jobs", "train-e2e", "vision-prod")
        done["status"] = {"conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": finished, "reason": "Completed"}]}
        api.put("jobs", done)

        async def settled() -> dict[str, Any] | None:
            now = await figures(pg_dsn, run_id)
            return now if now["reservations"] == {"reconciled"} else None

        end = await wait_for(settled, timeout=90, what="the reservation replaced by the metered actuals")
    finally:
        page.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await kube_client.close()
        await feed.aclose()

    assert sorted(end["events"]) == ["COMPLETED", "STARTED", "STORED"]  # each once (STORED and STARTED may share a second)
    assert end["holds"] == 0 and end["provisional"] == 0
    # Amounts are milli-GPU-seconds: four scrapes a second apart, two GPUs held at each, are about
    # 2 × 3 s (each interval counted whole, by the trapezoid rule), not the 4 GPU-hours projected.
    metered_milli = max(r["gpu_milli_hours_cumulative"] for r in await usage_rows(pg_dsn, run_id))
    assert 2 * 2_000 <= metered_milli <= 2 * 15_000, metered_milli
    ledger = await ledger_in_postgres(pg_dsn)
    for key in end["keys"]:
        if key.endswith("|gpu_hours"):
            assert ledger[key] == (0, metered_milli), key  # nothing reserved; consumed what was metered
    assert await ledger_in_redis(reconciler) == ledger
    assert await reconciler.ledger.run_holds() == {}
