"""The Kueue AdmissionCheck controller against a stand-in Kubernetes API server (no API server can
run here) and a real admission service: Workloads shaped as Kueue v1beta2 are watched, decided,
and their check states written back with merge patches guarded by resourceVersion; budgetgate's
permanent error answers end the wait. With Kueue's reactions modelled (tests/support/kueue_sim.py:
Retry evicts and requeues after requeueAfterSeconds, Rejected deactivates, all Ready admits), a
DELAY is decided once per requeue interval, a full quota is retried until it frees, an outage
until it ends, and a Workload being evicted is left alone."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from fastapi.responses import JSONResponse
from lightkube import AsyncClient as KubeClient

from budgetgate.client import AsyncClient, NO_RETRY
from budgetgate.adapters.kueue_controller import AdmissionCheckController
from budgetgate.adapters import kueue_workloads as kueue
from budgetgate.adapters.kueue_workloads import Retries
from budgetgate.core.principals import Role
from budgetgate.ledger.concurrency_holds import end_run_holds
from budgetgate.ledger.queries import sql
from budgetgate.platforms.kubernetes import Mapping
from tests.support.admission import apply_policies, budget_yaml, decision_of, example_policies, submission
from tests.support.kube_api import KubeApi, kube, kubeconfig  # noqa: F401 - pytest fixture
from tests.support.kueue_sim import KueueSim
from tests.support.principals import issue
from tests.support.principals import token_in_env  # noqa: F401 - pytest fixtures
from tests.support.servers import InProcessServer, free_port
from tests.support.waiting import wait_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kueue"

pytestmark = pytest.mark.usefixtures("token_in_env")


@asynccontextmanager
async def deciding(url: str, admission_url: str, **settings: Any) -> AsyncIterator[AdmissionCheckController]:
    """A controller on the stand-in API server at `url` and the admission service, its checks read."""
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    try:
        async with AsyncClient(admission_url) as budgetgate:
            controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate, **settings)
            await controller.refresh_checks()
            yield controller
    finally:
        await kube_client.close()


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def workload(name: str, *, job_uid: str, gpus_per_pod: int = 4, count: int = 2) -> dict[str, Any]:
    found = fixture("workload-job.json")
    found["metadata"]["name"] = name
    found["metadata"]["ownerReferences"][0]["uid"] = job_uid
    found["spec"]["podSets"][0]["count"] = count
    found["status"]["admission"]["podSetAssignments"][0]["count"] = count
    for where in ("requests", "limits"):
        found["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"][where]["nvidia.com/gpu"] = str(gpus_per_pod)
    return found


def check_state(api: KubeApi, name: str) -> dict[str, Any]:
    return next(c for c in api.get("workloads", name, "vision-prod")["status"]["admissionChecks"] if c["name"] == "budget")


async def test_workloads_waiting_on_the_check_are_decided(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put(
        "admissionchecks",
        {**fixture("admissioncheck.json"), "metadata": {"name": "someone-else", "generation": 1}, "spec": {"controllerName": "example.com/other"}},
    )
    api.put("workloads", workload("job-fits", job_uid="11111111-1111-4111-8111-111111111111"))  # 8 H100 × 6 h
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    async with AsyncClient(admission.url) as budgetgate:
        controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate)
        running = asyncio.create_task(controller.run())
        try:
            await wait_for(lambda: _decided(api, "job-fits"), what="the first Workload decided")
            api.put("workloads", workload("job-too-big", job_uid="22222222-2222-4222-8222-222222222222", gpus_per_pod=8, count=16))  # 128 × 6 h
            await wait_for(lambda: _decided(api, "job-too-big"), what="the second Workload decided")
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await kube_client.close()
    fits, too_big = check_state(api, "job-fits"), check_state(api, "job-too-big")
    assert fits["state"] == "Ready" and fits["message"].startswith("budgetgate: admitted")
    assert too_big["state"] == "Rejected" and "budgetgate: " in too_big["message"]
    decision = (await admission.client.get("/v1/admissions/11111111-1111-4111-8111-111111111111")).json()
    assert (decision["decision"], decision["projected_gpu_hours"]) == ("ALLOW", 48.0)
    # The other check of the Workload is left as Kueue set it.
    others = [c for c in api.get("workloads", "job-fits", "vision-prod")["status"]["admissionChecks"] if c["name"] != "budget"]
    assert others == [{"name": "provisioning", "state": "Ready", "lastTransitionTime": "2026-07-14T09:30:05Z", "message": "Provisioned"}]
    ours = api.get("admissionchecks", "budget")["status"]["conditions"]
    assert [(c["type"], c["status"]) for c in ours] == [("Active", "True")]
    assert "status" not in api.get("admissionchecks", "someone-else")
    assert {content_type for _, content_type, _ in api.patches} == {"application/merge-patch+json"}
    status_patches = [body for path, _, body in api.patches if path.endswith("/workloads/job-fits/status")]
    assert status_patches and all(body["metadata"]["resourceVersion"] for body in status_patches)


async def _decided(api: KubeApi, name: str) -> bool:
    try:
        return check_state(api, name)["state"] != "Pending"
    except KeyError:
        return False


async def test_a_workload_changed_meanwhile_is_not_overwritten(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    stale = api.put("workloads", workload("job-raced", job_uid="33333333-3333-4333-8333-333333333333"))
    stale = copy.deepcopy(stale)
    changed = copy.deepcopy(stale)
    changed["status"]["admissionChecks"][1]["message"] = "re-provisioned"
    api.put("workloads", changed)  # Kueue wrote in between
    async with deciding(url, admission.url) as controller:
        await controller.reconcile(stale)
    assert check_state(api, "job-raced")["state"] == "Pending"  # 409: left for the watch's newer version
    assert api.get("workloads", "job-raced", "vision-prod")["status"]["admissionChecks"][1]["message"] == "re-provisioned"
    assert kueue.pending_checks(api.get("workloads", "job-raced", "vision-prod"), {"budget"}) == ["budget"]


def readmitted(found: dict[str, Any], *, flavor: str | None = None, count: int | None = None) -> dict[str, Any]:
    """The Workload as Kueue leaves it after a preemption (or a deactivation) and a new quota
    reservation, on `flavor` or for `count` pods: our check Pending again, everything else as it was."""
    found = copy.deepcopy(found)
    assignment = found["status"]["admission"]["podSetAssignments"][0]
    if flavor is not None:
        assignment["flavors"]["nvidia.com/gpu"] = flavor
    if count is not None:
        assignment["count"] = found["spec"]["podSets"][0]["count"] = count
    for check in found["status"]["admissionChecks"]:
        if check["name"] == "budget":
            check.update(state="Pending", message="")
    return found


async def test_an_admitted_run_readmitted_on_another_flavor_is_rejected_not_retried(kube, admission) -> None:
    # Readmitted on a100 after its ALLOW on h100: the controller retried as attempt 2, which was
    # answered with the h100 run's stored ALLOW, and the Workload ran on a100 on it.
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-moved", job_uid="44444444-4444-4444-8444-444444444444"))
    async with deciding(url, admission.url) as controller:
        await controller.reconcile(api.get("workloads", "job-moved", "vision-prod"))
        assert check_state(api, "job-moved")["state"] == "Ready"
        admitted = (await admission.client.get("/v1/admissions/44444444-4444-4444-8444-444444444444")).json()
        await controller.reconcile(api.put("workloads", readmitted(api.get("workloads", "job-moved", "vision-prod"), flavor="a100")))
    ours = check_state(api, "job-moved")
    assert ours["state"] == "Rejected" and 'resources.flavor: "h100" → "a100"' in ours["message"] and "new run id" in ours["message"], ours
    assert "budgetgate.io/attempt" not in (api.get("workloads", "job-moved", "vision-prod")["metadata"].get("annotations") or {})
    decision = (await admission.client.get("/v1/admissions/44444444-4444-4444-8444-444444444444")).json()
    assert (decision["attempt"], decision["decision_id"]) == (1, admitted["decision_id"])  # nothing decided anew


async def test_a_refused_run_readmitted_for_another_request_is_retried_as_a_new_attempt(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-shrunk", job_uid="45454545-4545-4545-8545-454545454545", gpus_per_pod=8, count=16))  # 128 × 6 h: DENY
    async with deciding(url, admission.url) as controller:
        await controller.reconcile(api.get("workloads", "job-shrunk", "vision-prod"))
        assert check_state(api, "job-shrunk")["state"] == "Rejected"
        # Reactivated and admitted again for 2 pods: the same run id and attempt, another request.
        await controller.reconcile(api.put("workloads", readmitted(api.get("workloads", "job-shrunk", "vision-prod"), count=2)))
        moved = api.get("workloads", "job-shrunk", "vision-prod")
        ours = check_state(api, "job-shrunk")
        assert ours["state"] == "Retry" and "resources.gpus: 128 → 16" in ours["message"] and ours["message"].endswith("the next try is attempt 2")
        assert moved["metadata"]["annotations"]["budgetgate.io/attempt"] == "2"
        # Kueue makes the check Pending again after its retry delay: attempt 2 is a new question, decided afresh.
        await controller.reconcile(api.put("workloads", readmitted(moved)))
    assert check_state(api, "job-shrunk")["state"] == "Ready"
    decision = (await admission.client.get("/v1/admissions/45454545-4545-4545-8545-454545454545")).json()
    assert (decision["attempt"], decision["decision"], decision["projected_gpu_hours"]) == (2, "ALLOW", 96.0)


async def test_a_stale_workload_is_not_moved_to_another_attempt(kube, admission) -> None:
    # The requeue decides Workloads listed a while ago: deciding a stale copy wrote the raised
    # attempt annotation unguarded (only the status write was guarded), so a Workload Kueue had
    # moved on meanwhile was set to retry as another attempt.
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-stale", job_uid="66666666-6666-4666-8666-666666666666", gpus_per_pod=8, count=16))  # DENY
    async with deciding(url, admission.url) as controller:
        await controller.reconcile(api.get("workloads", "job-stale", "vision-prod"))
        stale = api.put("workloads", readmitted(api.get("workloads", "job-stale", "vision-prod"), count=2))  # would be a 409: Retry, attempt 2
        api.put("workloads", copy.deepcopy(stale))  # Kueue wrote in between
        await controller.reconcile(copy.deepcopy(stale))
    stored = api.get("workloads", "job-stale", "vision-prod")
    assert "budgetgate.io/attempt" not in (stored["metadata"].get("annotations") or {}), stored["metadata"]
    assert check_state(api, "job-stale")["state"] == "Pending"  # left for the newer version


async def test_an_invalid_submission_or_a_run_of_another_namespace_is_rejected(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    unpriced = workload("job-unpriced", job_uid="55555555-5555-4555-8555-555555555555")
    unpriced["status"]["admission"]["podSetAssignments"][0]["flavors"]["nvidia.com/gpu"] = "no-such-flavor"
    api.put("workloads", unpriced)
    api.put("workloads", workload("job-taken", job_uid="66666666-6666-4666-8666-666666666666"))
    # The run id was decided for another namespace first.
    taken = submission(run_id="66666666-6666-4666-8666-666666666666", namespace="vision-dev", job={"namespace": "vision-dev", "name": "x"})
    assert (await admission.client.post("/v1/admissions", json=taken)).status_code == 200
    async with deciding(url, admission.url) as controller:
        await controller.reconcile(api.get("workloads", "job-unpriced", "vision-prod"))
        await controller.reconcile(api.get("workloads", "job-taken", "vision-prod"))
    bad, other = check_state(api, "job-unpriced"), check_state(api, "job-taken")
    assert bad["state"] == "Rejected" and bad["message"].startswith("budgetgate: not a valid submission") and "resources.flavor" in bad["message"]
    assert other["state"] == "Rejected" and "namespace" in other["message"]
    assert "budgetgate.io/attempt" not in api.get("workloads", "job-taken", "vision-prod")["metadata"]["annotations"]


async def test_a_refused_controller_token_leaves_the_workload_pending_saying_so(kube, admission, pg_dsn) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-unknown-token", job_uid="77777777-7777-4777-8777-777777777777"))
    api.put("workloads", workload("job-reader-token", job_uid="88888888-8888-4888-8888-888888888888"))
    reader = await issue(pg_dsn, Role.READER)
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    for name, token in (("job-unknown-token", "not-a-token"), ("job-reader-token", reader)):
        async with AsyncClient(admission.url, token=token) as budgetgate:
            controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate)
            await controller.refresh_checks()
            await controller.reconcile(api.get("workloads", name, "vision-prod"))
    await kube_client.close()
    unknown, reading = check_state(api, "job-unknown-token"), check_state(api, "job-reader-token")
    assert unknown["state"] == "Pending" and unknown["message"].startswith("budgetgate refused the controller (401")
    assert "token is missing, unknown, revoked or expired" in unknown["message"]
    assert reading["state"] == "Pending" and reading["message"].startswith("budgetgate refused the controller (403")
    assert "lacks the submitter role" in reading["message"]


async def test_a_refused_token_is_decided_by_the_periodic_requeue_once_fixed(kube, admission) -> None:
    # Pending (an operator's fix) gets no new event by itself: the requeue lists it again.
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-token", job_uid="99999999-9999-4999-8999-999999999999"))
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    async with AsyncClient(admission.url, token="not-a-token", retry=NO_RETRY) as refused, AsyncClient(admission.url) as fixed:
        controller = AdmissionCheckController(kube=kube_client, budgetgate=refused, requeue_seconds=0.3)
        running = asyncio.create_task(controller.run())
        try:
            await wait_for(lambda: "refused the controller (401" in check_state(api, "job-token")["message"], what="the refusal written on the check")
            passes = api.lists["workloads"]
            await wait_for(lambda: api.lists["workloads"] >= passes + 3, what="two more requeue passes")
            assert len([p for p, _, _ in api.patches if p.endswith("/workloads/job-token/status")]) == 1  # the same answer is not written again
            controller.budgetgate = fixed  # the operator fixed the token; Kubernetes says nothing
            await wait_for(lambda: _decided(api, "job-token"), timeout=20, what="the Workload decided without a new event")
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await kube_client.close()
    assert check_state(api, "job-token")["state"] == "Ready"


# -- with Kueue's reactions (tests/support/kueue_sim.py) -------------------------------------------

QUOTA_VISION = """apiVersion: budgetgate/v1
kind: Quota
metadata: {id: tenant-vision}
spec: {tenant: vision, max_gpus: 8}
"""


@asynccontextmanager
async def with_kueue(api: KubeApi, url: str, admission_url: str, sim: KueueSim, **settings: Any) -> AsyncIterator[AdmissionCheckController]:
    """The controller running (watch and periodic requeue) on the sim's clock, and the sim."""
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    client_settings = {"retry": settings.pop("retry")} if "retry" in settings else {}
    async with AsyncClient(admission_url, **client_settings) as budgetgate:
        controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate, clock=sim.clock, **settings)
        tasks = [asyncio.create_task(controller.run()), asyncio.create_task(sim.run())]
        try:
            yield controller
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await kube_client.close()


async def decisions_of(dsn: str, run_id: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [(r["attempt"], r["outcome"]) for r in await conn.fetch("SELECT attempt, outcome FROM decisions WHERE run_id = $1 ORDER BY attempt", run_id)]
    finally:
        await conn.close()


async def delaying(admission_factory: Any, pg_dsn: str, *, sha: str) -> Any:
    """An admission service whose budget for team vision (100 GPU-hours, delaying when full)
    has 60 held by another run: a Workload asking 48 is delayed."""
    files = {"b.yaml": budget_yaml("vision-delay", namespace="vision-prod", labels="{team: vision}", limit="gpu_hours: 100", on_exhausted="delay")}
    await apply_policies(pg_dsn, files, sha=sha)
    server = await admission_factory()
    await server.wait_ready()
    holder = submission(run_id="holder", labels={"team": "vision"}, resources={"gpus": 8, "nodes": 1}, projected_runtime_hours=7.5)
    assert decision_of(await server.client.post("/v1/admissions", json=holder)) == "ALLOW"
    return server


def stored(api: KubeApi, name: str) -> dict[str, Any]:
    return api.get("workloads", name, "vision-prod")


async def test_a_delay_is_decided_once_per_requeue_interval_not_in_a_hot_loop(kube, admission_factory, pg_dsn) -> None:
    api, url = kube
    # 60 of the 100 GPU-hours held: the Workload's 48 wait for room.
    server = await delaying(admission_factory, pg_dsn, sha="d" * 40)
    run_id = "12121212-1212-4212-8212-121212121212"
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-delayed", job_uid=run_id))
    sim = KueueSim(api)
    async with with_kueue(api, url, server.url, sim, requeue_seconds=0.2):
        await wait_for(lambda: sim.happened("job-delayed", "quota released"), what="Kueue to evict the delayed Workload")
        first = await decisions_of(pg_dsn, run_id)
        assert first == [(1, "DELAY")]
        decision = (await server.client.get(f"/v1/admissions/{run_id}")).json()
        until = datetime.fromisoformat(decision["evaluations"][0]["next_eligible_time"].replace("Z", "+00:00"))
        evicted = stored(api, "job-delayed")
        (reset,) = [c for c in evicted["status"]["admissionChecks"] if c["name"] == "budget"]
        # Kueue reset the check (keeping the controller's requeueAfterSeconds) and waits until then.
        assert reset["state"] == "Pending" and reset["message"] == "Reset to Pending after eviction. Previously: Retry" and reset["retryCount"] == 1
        requeue_at = datetime.fromisoformat(evicted["status"]["requeueState"]["requeueAt"].replace("Z", "+00:00"))
        assert requeue_at >= until and requeue_at - until < timedelta(seconds=1)  # the decision's next eligible time, to the second
        assert evicted["metadata"]["annotations"]["budgetgate.io/attempt"] == "2"
        # Time passes for the controller (its requeue lists every 0.2 s) but not for Kueue: nothing is decided again.
        passes = api.lists["workloads"]
        await wait_for(lambda: api.lists["workloads"] >= passes + 5, what="five requeue passes")
        assert await decisions_of(pg_dsn, run_id) == first and sim.happened("job-delayed", "quota reserved") == 0
        # Kueue's backoff ends: quota reserved again, the check Pending, attempt 2 decided afresh, once.
        sim.advance((requeue_at - sim.now).total_seconds())

        async def second() -> bool:
            return len(await decisions_of(pg_dsn, run_id)) == 2 and sim.happened("job-delayed", "quota released") == 2

        await wait_for(second, what="the second decision and eviction")
        passes = api.lists["workloads"]
        await wait_for(lambda: api.lists["workloads"] >= passes + 5, what="five requeue passes")
        assert await decisions_of(pg_dsn, run_id) == [(1, "DELAY"), (2, "DELAY")]
        assert sim.happened("job-delayed", "quota reserved") == 1 and sim.happened("job-delayed", "admitted") == 0


async def test_a_full_quota_is_retried_and_admitted_once_capacity_frees(kube, admission_factory, pg_dsn) -> None:
    api, url = kube
    files = {"q.yaml": QUOTA_VISION, "b.yaml": budget_yaml("vision-big", namespace="vision-prod", labels="{team: vision}", limit="gpu_hours: 100000")}
    await apply_policies(pg_dsn, files, sha="q" * 40)
    server = await admission_factory()
    await server.wait_ready()
    holder = submission(run_id="holder", labels={"team": "vision"}, resources={"gpus": 8, "nodes": 1})
    assert decision_of(await server.client.post("/v1/admissions", json=holder)) == "ALLOW"  # the tenant's 8 GPUs all held
    run_id = "13131313-1313-4313-8313-131313131313"
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-waits", job_uid=run_id))  # 2 × 4 GPUs
    sim = KueueSim(api)
    async with with_kueue(api, url, server.url, sim, requeue_seconds=0.2, retries=Retries(quota_seconds=45)):
        await wait_for(lambda: sim.happened("job-waits", "quota released"), what="Kueue to evict the Workload")
        assert await decisions_of(pg_dsn, run_id) == [(1, "DENY")]
        evicted = stored(api, "job-waits")
        (reset,) = [c for c in evicted["status"]["admissionChecks"] if c["name"] == "budget"]
        assert reset["requeueAfterSeconds"] == 45 and evicted["metadata"]["annotations"]["budgetgate.io/attempt"] == "2"
        evictions = [c for c in evicted["status"]["conditions"] if c["type"] == "Evicted"]
        assert evictions[0]["reason"] == "AdmissionCheck" and "the quota is full now" in evictions[0]["message"]
        # Still full when Kueue asks again: another DENY, another Retry; no decision in between.
        sim.advance(45)
        await wait_for(lambda: sim.happened("job-waits", "quota released") == 2, what="the second eviction")
        assert await decisions_of(pg_dsn, run_id) == [(1, "DENY"), (2, "DENY")]
        # The holder ends: its GPUs are free, and the next try is admitted.
        async with server.rt.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("lock_ledger_shared"), 0)
            await end_run_holds(conn, server.rt.ledger, "holder")
        sim.advance(45)
        await wait_for(lambda: sim.happened("job-waits", "admitted"), what="Kueue to admit the Workload")
    assert await decisions_of(pg_dsn, run_id) == [(1, "DENY"), (2, "DENY"), (3, "ALLOW")]
    admitted = stored(api, "job-waits")
    (ready,) = [c for c in admitted["status"]["admissionChecks"] if c["name"] == "budget"]
    assert ready["state"] == "Ready" and "requeueAfterSeconds" not in ready and ready["retryCount"] == 2
    # The pods Kueue starts carry the run id (a UID: a label value as it is).
    assert ready["podSetUpdates"] == [{"name": "main", "labels": {"budgetgate.io/run-id": run_id}}]


async def test_a_rejected_workload_is_deactivated_and_not_decided_while_evicted(kube, admission_factory, pg_dsn) -> None:
    api, url = kube
    files = {"q.yaml": QUOTA_VISION, "b.yaml": budget_yaml("vision-big", namespace="vision-prod", labels="{team: vision}", limit="gpu_hours: 100000")}
    await apply_policies(pg_dsn, files, sha="r" * 40)
    server = await admission_factory()
    await server.wait_ready()
    run_id = "14141414-1414-4414-8414-141414141414"
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-too-wide", job_uid=run_id, gpus_per_pod=8))  # 16 GPUs: more than the quota itself
    # The job takes a while to stop: the Workload sits evicted, its check reset to Pending, with
    # quota reserved, through many watch events and requeue passes of the controller.
    sim = KueueSim(api, stop_steps=25)
    async with with_kueue(api, url, server.url, sim, requeue_seconds=0.1):
        await wait_for(lambda: sim.happened("job-too-wide", "evicted"), what="Kueue to evict the rejected Workload")
        evicting = stored(api, "job-too-wide")
        assert kueue.pending_checks({**evicting, "spec": {**evicting["spec"], "active": True}}, {"budget"}) == []  # Evicted alone is enough
        passes = api.lists["workloads"]
        await wait_for(lambda: api.lists["workloads"] >= passes + 3, what="three requeue passes while it is evicted")
        await wait_for(lambda: sim.happened("job-too-wide", "quota released"), what="the job to stop")
    assert await decisions_of(pg_dsn, run_id) == [(1, "DENY")]
    status_writes = [body for path, _, body in api.patches if path.endswith("/workloads/job-too-wide/status")]
    assert [next(c["state"] for c in b["status"]["admissionChecks"] if c["name"] == "budget") for b in status_writes] == ["Rejected"]
    assert "requested: 16" in status_writes[0]["status"]["admissionChecks"][0]["message"]
    final = stored(api, "job-too-wide")
    conditions = {c["type"]: c for c in final["status"]["conditions"]}
    assert final["spec"]["active"] is False
    assert (conditions["Evicted"]["status"], conditions["Evicted"]["reason"]) == ("True", "DeactivatedDueToAdmissionCheck")
    assert conditions["QuotaReserved"]["status"] == "False" and "DeactivationTarget" not in conditions
    assert check_state(api, "job-too-wide")["message"] == "Reset to Pending after eviction. Previously: Rejected"


async def test_an_outage_is_retried_after_the_outage_interval_and_decided_when_it_ends(kube, admission_factory, pg_dsn) -> None:
    api, url = kube
    server = await admission_factory()  # no policy bundle yet: submissions answer 503
    run_id = "15151515-1515-4515-8515-151515151515"
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-outage", job_uid=run_id))
    sim = KueueSim(api)
    async with with_kueue(api, url, server.url, sim, retry=NO_RETRY, retries=Retries(outage_seconds=20)):
        await wait_for(lambda: sim.happened("job-outage", "quota released"), what="Kueue to evict the undecided Workload")
        evicted = stored(api, "job-outage")
        assert "Previously: Retry" in check_state(api, "job-outage")["message"] and check_state(api, "job-outage")["requeueAfterSeconds"] == 20
        assert "budgetgate.io/attempt" not in evicted["metadata"]["annotations"]  # nothing was decided: the same attempt next time
        assert "cannot decide now" in next(c for c in evicted["status"]["conditions"] if c["type"] == "Evicted")["message"]
        await apply_policies(pg_dsn, example_policies(), sha="e" * 40)
        await server.wait_ready()
        sim.advance(20)
        await wait_for(lambda: sim.happened("job-outage", "admitted"), what="Kueue to admit the Workload once budgetgate decides")
    assert await decisions_of(pg_dsn, run_id) == [(1, "ALLOW")]


async def test_missing_attribution_is_rejected_and_cpu_only_work_let_through(kube, admission) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    unlabelled = workload("job-unlabelled", job_uid="16161616-1616-4616-8616-161616161616")
    del unlabelled["spec"]["podSets"][0]["template"]["metadata"]["labels"]["cost-center"]
    api.put("workloads", unlabelled)
    cpu = workload("job-cpu", job_uid="17171717-1717-4717-8717-171717171717")
    for where in ("requests", "limits"):
        del cpu["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"][where]["nvidia.com/gpu"]
    api.put("workloads", cpu)
    async with deciding(url, admission.url) as controller:
        await controller.reconcile(api.get("workloads", "job-unlabelled", "vision-prod"))
        await controller.reconcile(api.get("workloads", "job-cpu", "vision-prod"))
    unattributed = check_state(api, "job-unlabelled")
    assert unattributed["state"] == "Rejected" and "requires label cost-center" in unattributed["message"]
    through = check_state(api, "job-cpu")
    assert through["state"] == "Ready" and "let through without a decision" in through["message"] and "podSetUpdates" not in through
    assert (await admission.client.get("/v1/admissions/17171717-1717-4717-8717-171717171717")).status_code == 404  # nothing decided, nothing reserved
    # An operator who opts in has it decided, as 0 GPUs.
    api.put("workloads", workload("job-cpu-2", job_uid="18181818-1818-4818-8818-181818181818", gpus_per_pod=0))
    async with deciding(url, admission.url, mapping=Mapping(submit_cpu_only=True, default_flavor="h100")) as controller:
        await controller.reconcile(api.get("workloads", "job-cpu-2", "vision-prod"))
    decision = (await admission.client.get("/v1/admissions/18181818-1818-4818-8818-181818181818")).json()
    assert "decision" in decision, (decision, check_state(api, "job-cpu-2"))
    assert decision["decision"] == "ALLOW" and decision["projected_gpu_hours"] == 0.0
    assert check_state(api, "job-cpu-2")["podSetUpdates"] == [{"name": "main", "labels": {"budgetgate.io/run-id": "18181818-1818-4818-8818-181818181818"}}]


class FailingOnce:
    """The stand-in's app, answering the first request of `method` to a path ending `suffix` with
    a 500 (an API server failing one write) before passing everything through."""

    def __init__(self, app: Any, method: str, suffix: str) -> None:
        self.app, self.method, self.suffix, self.armed = app, method, suffix, True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.armed and scope["type"] == "http" and scope["method"] == self.method and scope["path"].endswith(self.suffix):
            self.armed = False
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcd timeout"}
            await JSONResponse(body, status_code=500)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def test_a_workload_whose_status_write_failed_is_decided_again_not_passed_over(admission_factory, pg_dsn) -> None:
    # The attempt annotation was written, then the status write failed: the Workload (attempt 2,
    # still Pending) is current, and is decided again rather than taken for the controller's own
    # version between its two writes.
    server = await delaying(admission_factory, pg_dsn, sha="f" * 40)
    run_id = "19191919-1919-4919-8919-191919191919"
    api = KubeApi()
    api.put("admissionchecks", fixture("admissioncheck.json"))
    api.put("workloads", workload("job-failed-write", job_uid=run_id))
    stand_in = InProcessServer(FailingOnce(api.app, "PATCH", "/workloads/job-failed-write/status"), port=free_port())
    await stand_in.start()
    kube_client = KubeClient(kubeconfig(stand_in.url), field_manager="budgetgate")
    try:
        async with AsyncClient(server.url) as budgetgate:
            controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate, requeue_seconds=0.2)
            running = asyncio.create_task(controller.run())
            try:
                await wait_for(lambda: _decided(api, "job-failed-write"), what="the Workload decided after the failed write")
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
    finally:
        await kube_client.close()
        await stand_in.stop()
    assert check_state(api, "job-failed-write")["state"] == "Retry"
    assert api.get("workloads", "job-failed-write", "vision-prod")["metadata"]["annotations"]["budgetgate.io/attempt"] == "3"
    assert await decisions_of(pg_dsn, run_id) == [(1, "DELAY"), (2, "DELAY")]


class KueueWritesBetween:
    """The stand-in's app, where Kueue writes the Workload (its provisioning check re-provisioned)
    right after the controller's first annotation write to it: the controller's status write,
    guarded by the version its annotation write made, then meets a 409."""

    def __init__(self, api: KubeApi, name: str) -> None:
        self.api, self.name, self.armed = api, name, True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.api.app(scope, receive, send)
        if self.armed and scope["type"] == "http" and scope["method"] == "PATCH" and scope["path"].endswith(f"/workloads/{self.name}"):
            self.armed = False
            changed = self.api.get("workloads", self.name, "vision-prod")
            changed["status"]["admissionChecks"][1]["message"] = "re-provisioned"
            self.api.put("workloads", changed)


async def test_a_kueue_write_between_the_attempt_and_the_status_carries_the_decision_over(admission_factory, pg_dsn) -> None:
    # The attempt annotation was raised, then Kueue wrote the Workload before the Retry was: the
    # decision made is written onto Kueue's version (Kueue's change kept), not taken back and
    # decided again as a third attempt with no Retry ever written for the second.
    server = await delaying(admission_factory, pg_dsn, sha="e" * 40)
    run_id = "17171717-1717-4717-8717-171717171717"
    api = KubeApi()
    api.put("admissionchecks", fixture("admissioncheck.json"))
    waiting = api.put("workloads", workload("job-raced-write", job_uid=run_id))
    stand_in = InProcessServer(KueueWritesBetween(api, "job-raced-write"), port=free_port())
    await stand_in.start()
    try:
        async with deciding(stand_in.url, server.url) as controller:
            await controller.reconcile(copy.deepcopy(waiting))
            # Kueue's version is the one written from now on: nothing left to decide on it.
            await controller.reconcile(api.get("workloads", "job-raced-write", "vision-prod"))
    finally:
        await stand_in.stop()
    found = api.get("workloads", "job-raced-write", "vision-prod")
    assert check_state(api, "job-raced-write")["state"] == "Retry"
    assert found["status"]["admissionChecks"][1]["message"] == "re-provisioned"
    assert found["metadata"]["annotations"]["budgetgate.io/attempt"] == "2"
    assert await decisions_of(pg_dsn, run_id) == [(1, "DELAY")]
