"""The Kueue AdmissionCheck controller against a stand-in Kubernetes API server (no API server can
run here) and a real admission service: Workloads shaped as Kueue v1beta1 are watched, decided,
and their check states written back with merge patches guarded by resourceVersion; budgetgate's
permanent error answers end the wait, and an outage is tried again by the periodic requeue."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient as KubeClient
from lightkube import KubeConfig

from budgetgate.client import AsyncClient, NO_RETRY
from budgetgate.adapters.kueue_controller import AdmissionCheckController
from budgetgate.adapters import kueue_workloads as kueue
from budgetgate.core.principals import Role
from tests.support.admission import apply_policies, example_policies, submission
from tests.support.kube_api import KubeApi
from tests.support.principals import issue
from tests.support.principals import token_in_env  # noqa: F401 - pytest fixtures
from tests.support.servers import InProcessServer, free_port
from tests.support.waiting import wait_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kueue"

pytestmark = pytest.mark.usefixtures("token_in_env")


def kubeconfig(url: str) -> KubeConfig:
    """A kubeconfig for the stand-in, with a bearer token as a service account would have."""
    return KubeConfig.from_dict({
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": {"server": url}}],
        "users": [{"name": "budgetgate", "user": {"token": "stand-in-token"}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "budgetgate"}}],
    })  # fmt: skip


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


@pytest.fixture
async def kube() -> AsyncIterator[tuple[KubeApi, str]]:
    api = KubeApi()
    server = InProcessServer(api.app, port=free_port())
    await server.start()
    yield api, server.url
    await server.stop()


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


async def test_a_workload_that_met_an_outage_is_decided_by_the_periodic_requeue(kube, admission_factory, pg_dsn) -> None:
    api, url = kube
    api.put("admissionchecks", fixture("admissioncheck.json"))
    server = await admission_factory()  # no policy bundle yet: submissions answer 503
    api.put("workloads", workload("job-outage", job_uid="99999999-9999-4999-8999-999999999999"))
    kube_client = KubeClient(kubeconfig(url), field_manager="budgetgate")
    async with AsyncClient(server.url, retry=NO_RETRY) as budgetgate:
        controller = AdmissionCheckController(kube=kube_client, budgetgate=budgetgate, requeue_seconds=0.5)
        running = asyncio.create_task(controller.run())
        try:

            async def told() -> bool:
                return "cannot decide now" in check_state(api, "job-outage")["message"]

            await wait_for(told, what="the outage written on the check")
            # Requeues meeting the same outage write nothing, so no event: the third list from
            # now begins after two whole passes.
            passes = api.lists["workloads"]
            await wait_for(lambda: api.lists["workloads"] >= passes + 3, what="two more requeue passes")
            status_patches = [path for path, _, _ in api.patches if path.endswith("/workloads/job-outage/status")]
            assert len(status_patches) == 1
            await apply_policies(pg_dsn, example_policies(), sha="e" * 40)  # admission recovers; Kubernetes says nothing
            await wait_for(lambda: _decided(api, "job-outage"), timeout=20, what="the Workload decided without a new event")
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await kube_client.close()
    assert check_state(api, "job-outage")["state"] == "Ready"
