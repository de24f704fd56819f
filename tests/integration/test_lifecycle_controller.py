"""The Kubernetes lifecycle controller (budgetgate.adapters.lifecycle_controller) against the
stand-in API server, with a real admission service (the validating webhook), metering-ingest
(`POST /v1/lifecycle/events`) and reconciler (Postgres, Redis, Kafka): two replicas elect a leader
on a Lease and only it publishes; a webhook-admitted Job that is stored is confirmed (STORED) and
kept past the provisional hold, one never stored is given back; the Job's pods and conditions
become STARTED and COMPLETED, each once, through a watch ended with 410 Gone and a re-list; Kueue
Workloads of budgetgate's check become EVICTED and READMITTED."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
from lightkube import AsyncClient as KubeClient

from budgetgate.adapters.leases import LeaderElection
from budgetgate.adapters.lifecycle_controller import LifecycleController
from budgetgate.client import AsyncClient
from budgetgate.contracts import wire
from budgetgate.contracts.topics import Topics
from budgetgate.core.principals import Role
from budgetgate.platforms.run_labels import RUN_LABEL, run_label_value
from budgetgate.v1.lifecycle_pb2 import LifecycleEvent, LifecycleType
from tests.support.kafka import drain
from tests.support.kube_api import KubeApi, kube, kubeconfig  # noqa: F401 - pytest fixture
from tests.support.kubernetes import admission_review, as_json, job
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.principals import issue
from tests.support.reconciler import reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.servers import InProcessServer
from tests.support.waiting import wait_for

URL = "/v1/kubernetes/admission-review"
H100 = {"budgetgate.io/flavor": "h100"}
HOLD = 8.0  # seconds of provisional hold


def stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@asynccontextmanager
async def replicas(url: str, metering_url: str, token: str, count: int = 2) -> AsyncIterator[list[LifecycleController]]:
    """`count` controller replicas electing a leader on one Lease, running until the block ends."""
    clients, controllers, tasks = [], [], []
    try:
        for i in range(count):
            kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
            feed = AsyncClient(metering_url=metering_url, token=token)
            clients += [kube_client, feed]
            election = LeaderElection(
                kube_client, name="budgetgate-lifecycle", namespace="budgetgate", identity=f"replica-{i}",
                lease_seconds=3, renew_deadline_seconds=2, retry_seconds=0.2,
            )  # fmt: skip
            controller = LifecycleController(
                kube=kube_client, publish=lambda events, feed=feed: feed.publish_lifecycle(*events), election=election, backoff_seconds=0.2
            )
            controllers.append(controller)
            tasks.append(asyncio.create_task(controller.run()))
        yield controllers
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.close() if isinstance(client, KubeClient) else await client.aclose()


async def webhook_job(admission, api: KubeApi, name: str, *, store: bool) -> tuple[str, dict[str, Any]]:  # type: ignore[no-untyped-def]
    """A Job admitted by the webhook (run id: its UID), stored in the stand-in if `store`."""
    obj = job(name=name, gpus=8, parallelism=1, deadline=6 * 3600, annotations=H100)
    answer = await admission.client.post(URL, json=admission_review(obj))
    assert answer.json()["response"]["allowed"] is True, answer.text
    body = as_json(obj)
    run_id = body["metadata"]["uid"]
    body["metadata"]["labels"] = {**body["metadata"].get("labels", {}), RUN_LABEL: run_label_value(run_id)}
    body["metadata"]["creationTimestamp"] = stamp(datetime.now(UTC))
    if store:
        api.put("jobs", body)
    return run_id, body


def pod_of(
    job_body: dict[str, Any], run_id: str, name: str, *, phase: str, started: datetime | None = None, finished: datetime | None = None
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if phase == "Running" and started:
        state = {"running": {"startedAt": stamp(started)}}
    elif started:
        state = {"terminated": {"startedAt": stamp(started), "finishedAt": stamp(finished or started), "exitCode": 0}}
    meta = job_body["metadata"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": meta["namespace"], "labels": {RUN_LABEL: run_label_value(run_id)}, "creationTimestamp": stamp(datetime.now(UTC)),
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"], "controller": True}],
        },
        "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}] if state else []},
    }  # fmt: skip


async def events_of(dsn: str, run_id: str) -> list[tuple[str, datetime, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT kind, event_time, gpus FROM lifecycle_events WHERE run_id = $1 ORDER BY event_time, kind", run_id)
        return [(r["kind"], r["event_time"], r["gpus"]) for r in rows]
    finally:
        await conn.close()


async def reservation_states(dsn: str, run_id: str) -> set[tuple[str, str | None]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {(r["state"], r["end_reason"]) for r in await conn.fetch("SELECT state, end_reason FROM reservations WHERE run_id = $1", run_id)}
    finally:
        await conn.close()


async def test_a_webhook_job_is_confirmed_started_and_completed_once_by_the_leader(kube, admission, metering, reconciler_factory, pg_dsn) -> None:
    api, url = kube
    # No metering here: a finished run is charged its bound GPUs × wall time a second after its end.
    reconciler = await reconciler_factory(provisional_hold_seconds=HOLD, provisional_grace_seconds=1)
    await wait_for(lambda: reconciler.consuming, what="the reconciler consuming")
    token = await issue(pg_dsn, Role.EXPORTER)
    admitted = time.monotonic()
    kept, kept_job = await webhook_job(admission, api, "train-kept", store=True)
    never, _ = await webhook_job(admission, api, "train-refused-later", store=False)  # another webhook refused it
    async with replicas(url, metering.url, token) as controllers:
        await wait_for(lambda: sum(c.leading for c in controllers) == 1, timeout=10, what="one replica leading")
        leader = next(c for c in controllers if c.leading)
        follower = next(c for c in controllers if not c.leading)

        async def stored() -> bool:
            return [k for k, _, _ in await events_of(pg_dsn, kept)] == ["STORED"]

        await wait_for(stored, timeout=30, what="STORED of the stored Job recorded by the reconciler")
        started = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)
        api.put("pods", pod_of(kept_job, kept, "train-kept-0", phase="Running", started=started))

        async def running() -> bool:
            return "STARTED" in [k for k, _, _ in await events_of(pg_dsn, kept)]

        await wait_for(running, timeout=30, what="STARTED recorded")

        async def refused_given_back() -> bool:
            return {s for s, _ in await reservation_states(pg_dsn, never)} == {"released"}

        await wait_for(refused_given_back, timeout=40, what="the hold of the Job never stored given back")
        assert all(why.startswith("the object was never stored") for _, why in await reservation_states(pg_dsn, never))  # type: ignore[union-attr]
        await asyncio.sleep(max(0.0, HOLD + 1 - (time.monotonic() - admitted)))
        assert {s for s, _ in await reservation_states(pg_dsn, kept)} == {"held"}  # confirmed: kept past the provisional hold
        # The watches end with 410 Gone: the replicas list again, and the facts they derive anew
        # are the ones already published.
        restarts = leader.watch_restarts
        assert api.expire_watches("pods") == 2 and api.expire_watches("jobs") == 2
        await wait_for(lambda: leader.watch_restarts >= restarts + 2, timeout=10, what="the leader's watches restarted")
        finished = datetime.now(UTC).replace(microsecond=0)
        api.put("pods", pod_of(kept_job, kept, "train-kept-0", phase="Succeeded", started=started, finished=finished))
        done = copy.deepcopy(api.get("jobs", "train-kept", "vision-prod"))
        done["status"] = {"conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": stamp(finished), "reason": "Completed"}]}
        api.put("jobs", done)

        async def reconciled() -> bool:
            return {s for s, _ in await reservation_states(pg_dsn, kept)} == {"reconciled"}

        await wait_for(reconciled, timeout=40, what="the completed run settled: reservation replaced by actuals")
        await asyncio.sleep(1)  # a late duplicate would have arrived by now
        events = {kind: (at, gpus) for kind, at, gpus in await events_of(pg_dsn, kept)}
        assert len(await events_of(pg_dsn, kept)) == len(events) == 3  # one of each, however often derived
        assert events["STARTED"] == (started, 8) and events["COMPLETED"][0] == finished and events["STORED"][0] <= started
        assert follower.published_events == 0 and leader.published_events == 3
        assert await events_of(pg_dsn, never) == []


def workload(name: str, job_uid: str, *conditions: tuple[str, str, datetime, str]) -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {
            "name": name, "namespace": "vision-prod", "creationTimestamp": stamp(datetime.now(UTC)),
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "train-queued", "uid": job_uid, "controller": True}],
        },
        "spec": {"podSets": [{"name": "main", "count": 1, "template": {"spec": {"containers": [
            {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}}]},
        "status": {
            "conditions": [{"type": t, "status": s, "lastTransitionTime": stamp(at), "reason": r, "message": r} for t, s, at, r in conditions],
            "admission": {"clusterQueue": "gpus", "podSetAssignments": [{"name": "main", "count": 1, "flavors": {"nvidia.com/gpu": "h100"}}]},
            "admissionChecks": [{"name": "budget", "state": "Ready", "lastTransitionTime": stamp(datetime.now(UTC)), "message": "admitted"}],
        },
    }  # fmt: skip


async def test_kueue_evictions_and_readmissions_are_published_once_each(kube, metering, pg_dsn, settings) -> None:
    """A Workload of budgetgate's check (run id: its owner Job's UID), evicted and admitted again:
    EVICTED and READMITTED published once each, through a second controller after a restart; a
    Workload of another check is not followed."""
    api, url = kube
    token = await issue(pg_dsn, Role.EXPORTER)
    job_uid = "5b0e6f5c-1f1e-4c2a-9a3b-7c8d9e0f1a2b"
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)
    posted: list[Any] = []
    async with AsyncClient(metering_url=metering.url, token=token) as feed:

        async def publish(events) -> Any:  # type: ignore[no-untyped-def]
            posted.extend(events)
            return await feed.publish_lifecycle(*events)

        async with running_controller(url, publish):
            api.put("workloads", workload("job-train-queued", job_uid, ("Admitted", "True", t0, "Admitted")))
            other = workload("job-other", "6c1f7a6d-2a2f-4d3b-8b4c-8d9e0f1a2b3c", ("Evicted", "True", t0, "Preempted"))
            other["status"]["admissionChecks"] = [{"name": "someone-elses", "state": "Ready"}]
            api.put("workloads", other)
            await wait_for(lambda: [e.run_id for e in posted] == [job_uid], timeout=20, what="STORED of the followed Workload")
            evicted = workload("job-train-queued", job_uid, ("Admitted", "False", t0 + timedelta(minutes=5), "Evicted"),
                               ("Evicted", "True", t0 + timedelta(minutes=5), "Preempted"))  # fmt: skip
            api.put("workloads", evicted)
            await wait_for(lambda: len(posted) == 2, timeout=20, what="EVICTED published")
        # A restart: the new controller derives everything again; only the readmission is new.
        async with running_controller(url, publish):
            readmitted = workload("job-train-queued", job_uid, ("Admitted", "True", t0 + timedelta(minutes=9), "Admitted"),
                                  ("Evicted", "False", t0 + timedelta(minutes=9), "QuotaReserved"))  # fmt: skip
            api.put("workloads", readmitted)
            await wait_for(lambda: any(e.type == 6 for e in posted), timeout=20, what="READMITTED published")
            await asyncio.sleep(0.5)
    ids = [e.event_id for e in posted]
    unique = {e.event_id: e for e in posted}.values()
    kinds = {LifecycleType.Name(e.type): e.event_time.ToDatetime(tzinfo=UTC) for e in unique}
    assert len(kinds) == len(unique) == 3  # one event of each kind
    assert kinds["EVICTED"] == t0 + timedelta(minutes=5) and kinds["READMITTED"] == t0 + timedelta(minutes=9) and "STORED" in kinds
    assert all(e.run_id == job_uid for e in posted)
    assert len(ids) - len(set(ids)) <= 2  # the restarted controller may resend STORED and EVICTED (same ids: deduplicated downstream)


@asynccontextmanager
async def running_controller(url: str, publish) -> AsyncIterator[LifecycleController]:  # type: ignore[no-untyped-def]
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    controller = LifecycleController(kube=kube_client, publish=publish, backoff_seconds=0.2)
    task = asyncio.create_task(controller.run())
    try:
        yield controller
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube_client.close()


def bare_pod(name: str, run_id: str, *, phase: str, started: datetime | None = None, finished: datetime | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if phase == "Running" and started:
        state = {"running": {"startedAt": stamp(started)}}
    elif started:
        state = {"terminated": {"startedAt": stamp(started), "finishedAt": stamp(finished or started), "exitCode": 0}}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "vision-prod", "uid": f"uid-{name}", "labels": {RUN_LABEL: run_id},
                     "creationTimestamp": stamp(datetime.now(UTC))},
        "spec": {"nodeName": "gpu-node-2", "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]},
        "status": {"phase": phase, "containerStatuses": [{"name": "main", "state": state}] if state else []},
    }  # fmt: skip


async def test_outages_of_the_api_server_and_of_metering_ingest_are_waited_out(kube) -> None:
    """The API server going away ends the watches (listed again with backoff once it is back, what
    changed meanwhile derived from the new list); publications failing are retried with backoff.
    Every fact is published once it goes through, none twice; a bare pod deleted before it
    finished cancels its run."""
    api, url = kube
    port = int(url.rsplit(":", 1)[1])
    delivered: list[Any] = []
    failures = {"left": 3}

    async def flaky(events) -> None:  # type: ignore[no-untyped-def]
        if failures["left"]:
            failures["left"] -= 1
            raise httpx.ConnectError("metering-ingest unreachable")
        delivered.extend(events)

    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    api.put("pods", bare_pod("solo", "run-solo", phase="Running", started=t0))
    async with running_controller(url, flaky) as controller:
        await wait_for(lambda: {LifecycleType.Name(e.type) for e in delivered} == {"STORED", "STARTED"}, timeout=30, what="facts through the outage")
        assert failures["left"] == 0
        restarts = controller.watch_restarts
        await kube_server_restart(
            api, port, between=lambda: api.put("pods", bare_pod("solo", "run-solo", phase="Succeeded", started=t0, finished=t0 + timedelta(minutes=5)))
        )
        await wait_for(lambda: controller.watch_restarts > restarts, timeout=20, what="the watches ended by the outage")
        await wait_for(lambda: any(LifecycleType.Name(e.type) == "COMPLETED" for e in delivered), timeout=30, what="COMPLETED from the list after the outage")
        api.put("pods", bare_pod("gone", "run-gone", phase="Running", started=t0))
        await wait_for(lambda: any(e.run_id == "run-gone" and LifecycleType.Name(e.type) == "STARTED" for e in delivered), timeout=20, what="run-gone started")
        api.delete("pods", "gone", "vision-prod")
        await wait_for(
            lambda: any(e.run_id == "run-gone" and LifecycleType.Name(e.type) == "CANCELLED" for e in delivered), timeout=20, what="run-gone cancelled"
        )
    ids = [e.event_id for e in delivered]
    assert len(ids) == len(set(ids))  # nothing published twice by one controller
    solo = {LifecycleType.Name(e.type): e.event_time.ToDatetime(tzinfo=UTC) for e in delivered if e.run_id == "run-solo"}
    assert solo["STARTED"] == t0 and solo["COMPLETED"] == t0 + timedelta(minutes=5) and set(solo) == {"STORED", "STARTED", "COMPLETED"}


async def kube_server_restart(api: KubeApi, port: int, *, between) -> None:  # type: ignore[no-untyped-def]
    """Stop the stand-in serving (watches cut, calls refused), change the cluster meanwhile, serve again on the same port."""
    assert api.serving is not None
    api.serving.server.force_exit = True  # not waiting for the open watches
    await api.serving.stop()
    for plural in ("pods", "jobs", "workloads"):  # the open watches told to go (the stand-in keeps serving them otherwise)
        api.expire_watches(plural)
    await asyncio.sleep(1.0)  # lists and watches refused meanwhile
    between()
    api.serving = InProcessServer(api.app, port=port)
    await api.serving.start()


async def test_the_command_elects_itself_and_publishes(kube, metering, settings, pg_dsn, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`budgetgate kubernetes lifecycle` as the Deployment runs it (its own process, a kubeconfig,
    the Lease in its namespace): it takes the Lease and its facts reach workload.lifecycle.v1."""
    api, url = kube
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "budgetgate", "user": {"token": "stand-in-token"}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "budgetgate"}}],
    }))  # fmt: skip
    token = await issue(pg_dsn, Role.EXPORTER)
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=3)
    api.put("pods", bare_pod("cli-solo", "run-cli", phase="Running", started=t0))
    command = [sys.executable, "-m", "budgetgate.cli.main", "kubernetes", "lifecycle", "--kubeconfig", str(config), "--identity", "cli-replica",
               "--lease-seconds", "3", "--renew-deadline", "2", "--retry-seconds", "0.2"]  # fmt: skip
    env = {**os.environ, "BUDGETGATE_METERING_URL": metering.url, "BUDGETGATE_TOKEN": token, "POD_NAMESPACE": "budgetgate"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: (api.find("leases", "budgetgate-lifecycle", "budgetgate") or {}).get("spec", {}).get("holderIdentity") == "cli-replica",
                       timeout=30, what="the command holding the Lease")  # fmt: skip
        records = await drain(settings.kafka_bootstrap, Topics(settings.topic_prefix).lifecycle, 2)
        events = sorted((LifecycleType.Name(e.type), e.run_id) for e in (wire.decode(LifecycleEvent, r.value, r.headers) for r in records))
        assert events == [("STARTED", "run-cli"), ("STORED", "run-cli")]
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert "leads (lease budgetgate/budgetgate-lifecycle)" in output, output


def test_the_command_needs_a_namespace_for_its_lease(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from budgetgate.cli import kubernetes as command
    from budgetgate.cli.main import cli

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(command, "SERVICE_ACCOUNT_NAMESPACE", Path("/nonexistent/namespace"))
    result = CliRunner().invoke(cli, ["kubernetes", "lifecycle", "--metering-url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "no namespace for the Lease" in result.output
    result = CliRunner().invoke(cli, ["kubernetes", "lifecycle", "--lease-namespace", "b", "--renew-deadline", "20"])
    assert result.exit_code == 2 and "--retry-seconds < --renew-deadline < --lease-seconds" in result.output
